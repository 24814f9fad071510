"""cluster: see ARCHITECTURE.md."""

"""router: see ARCHITECTURE.md."""

"""proto: see ARCHITECTURE.md."""

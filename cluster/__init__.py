"""cluster: see ../shared/ARCHITECTURE.md and the README's layout."""

"""decode_worker: see ARCHITECTURE.md."""

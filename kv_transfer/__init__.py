"""kv_transfer: see ARCHITECTURE.md."""

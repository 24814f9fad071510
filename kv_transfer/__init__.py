"""kv_transfer: see docs/architecture.md."""

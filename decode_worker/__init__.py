"""decode_worker: see docs/architecture.md."""

"""prefill_worker: see docs/architecture.md."""

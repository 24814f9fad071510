"""prefill_worker: see ARCHITECTURE.md."""

"""router: see docs/architecture.md."""

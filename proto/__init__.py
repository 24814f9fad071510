"""proto: see docs/architecture.md."""

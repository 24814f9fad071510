"""Benchmarks, soak and load generation: what measures a deployment, apart from what runs it.

The `pdserve bench ...` and `pdserve soak` commands are defined here too (`cli.add_commands`).
"""

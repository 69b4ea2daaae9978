"""Benchmarks of jax_sparse_kv: ``python -m benchmarks.run`` (``--quick`` for a smoke run)."""

"""Helpers of the tests (plain functions and classes; pytest's fixtures stay in tests/conftest.py).

tests/ is on sys.path in a pytest run (rootdir-relative ``prepend`` imports), so a test imports ``support.<module>``.

- common: small layouts, the dtypes under test, a NumPy reference of the saturating cast, raw-bit views.
- memory_maps: dropping JAX's compiled programs before XLA:CPU's memory maps run out.
- reference: a NumPy reference of the whole cache, written from the contract.
- reference_ops: the slow reference ops (the first implementation) the chunked ops are compared with.
- serving_reference: the engine's reference, each prompt decoded alone, and the fixture models.
- m3_reference: transformers' MiniMax-M3 as the reference: tiny random models, their checkpoints, greedy runs.
- vl_reference: transformers' MiniMax-M3 VL as the reference: a tiny random VL model, its checkpoint, images.
- fp8_checkpoints: block-fp8 and MXFP8 checkpoints written from the formats' definitions.
- multihost_helpers: free ports; local processes x CPU devices under ``jax.distributed``.
- server_process: a real `serve` process (start on a free port, wait for /health, SIGTERM, /metrics).
- torchvision_shim: a minimal torchvision stand-in so that transformers' image processor runs.
"""

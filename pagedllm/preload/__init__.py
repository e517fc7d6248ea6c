"""Preloaded weights (vLLM's ``preload`` daemon): ``pagedllm preload MODEL`` loads a model once,
after every load-time transformation (quantization, packing, float32 copies, this rank's
tensor-parallel shard), and keeps it in shared memory; ``pagedllm serve MODEL
--load-format ipc_cache`` maps it instead of loading the checkpoint.

- ``key``: what the stored weights were made from (``cache_key``), compared field by field.
- ``store``: the stored model (a pickled skeleton + one mappable file of tensor bytes).
- ``ipc_cache``: the loader's side (``load_preloaded``).
- ``daemon`` / ``control``: the daemon and its control socket (list / status / evict / stop).
"""

"""Snapshots of a server (vLLM's ``snapshot create`` / ``restore``): ``pagedllm snapshot create
NAME [serve flags]`` keeps the server's configuration (its ``pagedllm serve`` flags), copies of
its ``--lora-modules`` adapters and its loaded weights (a store of ``pagedllm.preload``: the
weights after every load-time transformation, in one mappable file) under
``PAGEDLLM_SNAPSHOT_DIR/NAME``; ``restore NAME`` starts ``pagedllm serve`` from it, mapping
the weights (``--load-format ipc_cache``) instead of loading the checkpoint.

A process image (CRIU) is not available in this container, so a snapshot is this engine
image of our own, not a frozen process: restoring still starts a fresh interpreter.
"""

"""Moving KV-cache blocks out of and into a worker's cache tensors: ``kv_blocks`` (a block's
bytes, every layer), ``offloading`` (the second KV tier's store and its copy thread)."""

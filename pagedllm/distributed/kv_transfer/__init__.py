"""Moving KV-cache blocks between a worker's cache tensors and somewhere else.

The second KV tier (``--kv-offloading-size``): ``kv_blocks`` (a block's bytes, every layer)
and ``offloading`` (the tier's RAM / disk store and its copy thread).

KV transfer between engines, a prefill / decode split (vLLM's KV connector design): a
*producer* (prefill instance) computes a request's prompt and keeps its KV; a *consumer*
(decode instance) loads that KV instead of computing it and generates the output. A
connector has two halves (``base``): the scheduler side (no torch) counts the tokens a
request gets from a remote engine, and writes each step's loads and saves in
``SchedulerOutput.kv_connector_metadata``; the worker side moves the bytes in and out of the
paged KV cache (``block_copy``). ``tcp_connector`` is the TCP (ZeroMQ) connector; ``factory``
builds the connector ``KVTransferConfig.kv_connector`` names.
"""

"""gRPC beside HTTP (``pagedllm serve --grpc``): the ``pagedllm.v1.Generation`` service of
``pagedllm_generation.proto`` — Generate (server-streamed text and token ids), Abort, Health,
ModelInfo — served from the same engine as the OpenAI routes.

``stubs`` generates the proto's Python modules (cached per machine), ``servicer`` implements
the service, ``server`` starts it. ``python -m pagedllm.entrypoints.grpc`` generates the
stubs now (``make install`` does), and prints where they are.
"""

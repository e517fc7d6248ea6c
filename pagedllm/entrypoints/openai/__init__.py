"""The OpenAI-compatible HTTP server (``pagedllm serve``).

- ``cli_args``: the ``serve`` flags (vLLM's names) and ``main``, which runs uvicorn.
- ``api_server``: the FastAPI app (``build_app``), auth, ``/health``, ``/metrics``.
- ``protocol``: request and response bodies; ``errors``: OpenAI's error JSON.
- ``serving_completion``, ``serving_chat``, ``serving_models``, ``serving_tokenization``:
  one class per group of endpoints, on top of ``AsyncLLM``.
"""

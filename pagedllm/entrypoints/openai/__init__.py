"""The OpenAI-compatible HTTP server (``pagedllm serve``).

- ``cli_args``: the ``serve`` flags (vLLM's names) and ``main``, which runs uvicorn.
- ``api_server``: the FastAPI app (``build_app``), auth, ``/health``, ``/metrics``.
- ``protocol``: request and response bodies; ``errors``: OpenAI's error JSON.
- ``serving_engine``: ``OpenAIServing``, the base of the generating endpoints
  (validation through the engine's ``Processor``, the engine call, SSE streams).
- ``serving_completion``, ``serving_chat``: the generating endpoints, on top of ``AsyncLLM``;
  ``serving_tokenization`` (``/tokenize``, ``/detokenize``) and ``serving_models`` need no engine.
- ``renderer``: ``PromptRenderer`` (tokenize, chat template), shared by all of them;
  ``logprobs``: logprob helpers of the responses.
- ``tool_calls`` and ``tool_parsers``: tool calling in chat completions (``tool_choice``
  modes, ``--tool-call-parser`` formats, streamed calls).
"""

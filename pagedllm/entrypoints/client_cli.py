"""``pagedllm chat`` and ``pagedllm complete``: terminal clients of a running OpenAI-compatible
server (``pagedllm serve``, vLLM's, any other), with vLLM's flags (``vllm chat`` / ``vllm
complete``): ``--url`` (the API's base URL), ``--model-name`` (default: the first model of
``/models``), ``--api-key`` (default: ``$OPENAI_API_KEY``), ``-q/--quick MESSAGE`` (one
request, then exit); ``chat`` also takes ``--system-prompt``, ``complete`` ``--max-tokens``.

``chat`` keeps the conversation (each request sends every turn so far) and streams each reply
from ``/chat/completions``; ``complete`` streams the completion of each prompt from
``/completions``. At the ``> `` prompt, Ctrl-D or Ctrl-C exits (code 0); Ctrl-C during a
reply stops that reply (the server aborts the request) and the prompt comes back. A server
that cannot be reached or answers an error is one line on stderr (``pagedllm chat: error:
...``): exit code 1 for ``-q`` and at start-up, the next prompt otherwise.

Light at import (argparse only): ``httpx`` is imported when a command runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Iterator, Optional

from pagedllm.entrypoints.sse_client import DONE, sse_events

#: vLLM's default ``--url``: a server on this machine's port 8000.
DEFAULT_URL = "http://localhost:8000/v1"
#: Seconds to wait for the server's first byte (a long prompt may queue) and between stream events.
READ_TIMEOUT_S = 600.0


class ClientError(Exception):
    """The server could not be reached, or answered an error (the message says which)."""


class ServerClient:
    """The few OpenAI routes the commands use, over ``httpx``, at ``url`` (the base URL, ending
    in ``/v1`` for pagedllm and vLLM) with ``api_key`` as a Bearer token (None: none sent)."""

    def __init__(self, url: str, api_key: Optional[str]) -> None:
        import httpx

        self.url = url.rstrip("/")
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._http = httpx.Client(headers=headers, timeout=httpx.Timeout(10.0, read=READ_TIMEOUT_S))
        self._errors = (httpx.HTTPError,)

    def first_model(self) -> str:
        """The id of the first model ``GET /models`` lists.

        Raises:
            ClientError: unreachable, an error answer, or no model listed.
        """
        try:
            response = self._http.get(self.url + "/models")
        except self._errors as exc:
            raise ClientError(f"cannot reach {self.url}: {exc}") from None
        models = self._checked(response).json().get("data") or []
        if not models:
            raise ClientError(f"{self.url}/models lists no model; pass --model-name")
        return models[0]["id"]

    def stream(self, route: str, body: dict[str, Any]) -> Iterator[dict[str, Any]]:
        """The JSON events of a streamed ``POST route`` (``/chat/completions``, ``/completions``)
        with ``body`` (``stream`` set); closing the iterator closes the connection.

        Raises:
            ClientError: unreachable, an error answer, or an error event in the stream.
        """
        try:
            with self._http.stream("POST", self.url + route, json={**body, "stream": True}) as response:
                if response.status_code >= 400:
                    response.read()
                    self._checked(response)
                for data in sse_events(response.iter_lines()):
                    if data == DONE:
                        return
                    event = json.loads(data)
                    if "error" in event:
                        raise ClientError(_error_message(event, "the stream ended with an error"))
                    yield event
        except self._errors as exc:
            raise ClientError(f"cannot reach {self.url}: {exc}") from None

    @staticmethod
    def _checked(response: Any) -> Any:
        if response.status_code < 400:
            return response
        try:
            message = _error_message(response.json(), response.text)
        except ValueError:
            message = response.text.strip() or response.reason_phrase
        raise ClientError(f"{response.status_code} from {response.request.url}: {message}")

    def close(self) -> None:
        self._http.close()


def _error_message(body: Any, fallback: str) -> str:
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict):
        return str(error.get("message") or fallback)
    return str(error or fallback)


def _print_stream(events: Iterator[dict[str, Any]], piece_of: Any) -> str:
    """Print each event's text (``piece_of(choice)``) as it comes; returns the whole text.
    Ctrl-C stops the stream (the connection closes) and keeps what came."""
    text = []
    try:
        for event in events:
            for choice in event.get("choices") or []:
                piece = piece_of(choice) or ""
                text.append(piece)
                print(piece, end="", flush=True)
    except KeyboardInterrupt:
        print(" [stopped]", end="")
    finally:
        close = getattr(events, "close", None)
        if close is not None:
            close()
    print(flush=True)
    return "".join(text)


def _read_line() -> Optional[str]:
    """The next line typed at the ``> `` prompt; None on Ctrl-D / Ctrl-C (exit)."""
    try:
        return input("> ")
    except (EOFError, KeyboardInterrupt):
        print()
        return None


def _connect(args: argparse.Namespace) -> tuple[ServerClient, str]:
    """(client, model name) of the common flags; prints "Using model: NAME".

    Raises:
        ClientError: no ``--model-name`` and the model list cannot be read.
    """
    client = ServerClient(args.url, args.api_key or _api_key_from_env())
    try:
        model = args.model_name or client.first_model()
    except ClientError:
        client.close()
        raise
    print(f"Using model: {model}", flush=True)
    return client, model


def _api_key_from_env() -> Optional[str]:
    """``$OPENAI_API_KEY``, the key when ``--api-key`` is not given (the OpenAI clients' and
    vLLM's variable; not pagedllm's own, so not in ``pagedllm.envs``)."""
    return os.environ.get("OPENAI_API_KEY")


def _fail(prog: str, message: str) -> int:
    print(f"{prog}: error: {message}", file=sys.stderr, flush=True)
    return 1


def chat_main(args: argparse.Namespace) -> int:
    """``pagedllm chat``: see the module docstring. Returns the exit code."""
    try:
        client, model = _connect(args)
    except ClientError as exc:
        return _fail("pagedllm chat", str(exc))
    history: list[dict[str, str]] = [{"role": "system", "content": args.system_prompt}] if args.system_prompt else []
    try:
        while True:
            message = args.quick if args.quick is not None else _read_line()
            if message is None:
                return 0
            history.append({"role": "user", "content": message})
            try:
                events = client.stream("/chat/completions", {"model": model, "messages": history})
                reply = _print_stream(events, lambda choice: (choice.get("delta") or {}).get("content"))
            except ClientError as exc:
                history.pop()
                if args.quick is not None:
                    return _fail("pagedllm chat", str(exc))
                print(f"pagedllm chat: error: {exc}", file=sys.stderr, flush=True)
                continue
            history.append({"role": "assistant", "content": reply})
            if args.quick is not None:
                return 0
    finally:
        client.close()


def complete_main(args: argparse.Namespace) -> int:
    """``pagedllm complete``: see the module docstring. Returns the exit code."""
    try:
        client, model = _connect(args)
    except ClientError as exc:
        return _fail("pagedllm complete", str(exc))
    try:
        while True:
            prompt = args.quick if args.quick is not None else _read_line()
            if prompt is None:
                return 0
            body = {"model": model, "prompt": prompt}
            if args.max_tokens is not None:
                body["max_tokens"] = args.max_tokens
            try:
                _print_stream(client.stream("/completions", body), lambda choice: choice.get("text"))
            except ClientError as exc:
                if args.quick is not None:
                    return _fail("pagedllm complete", str(exc))
                print(f"pagedllm complete: error: {exc}", file=sys.stderr, flush=True)
                continue
            if args.quick is not None:
                return 0
    finally:
        client.close()


def _positive_int(value: str) -> int:
    try:
        number = int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}") from None
    if number < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {value!r}")
    return number


def _add_common_flags(parser: argparse.ArgumentParser, quick_help: str) -> None:
    parser.add_argument("--url", default=DEFAULT_URL, help=f"Base URL of the server's OpenAI API (default: {DEFAULT_URL}).")
    parser.add_argument(
        "--model-name", default=None,
        help="The model to use (the 'model' field); default: the first one the server lists at /models.",
    )  # fmt: skip
    parser.add_argument(
        "--api-key", default=None, help="The server's API key, sent as a Bearer token; default: $OPENAI_API_KEY."
    )
    parser.add_argument("-q", "--quick", default=None, metavar="MESSAGE", help=quick_help)


def register(subparsers: Any) -> None:
    """Add ``chat`` and ``complete`` to the ``pagedllm`` command (``func``: their mains)."""
    chat = subparsers.add_parser(
        "chat", help="Chat with a running server from the terminal.",
        description="Chat with the model of a running OpenAI-compatible server (pagedllm serve): each reply "
        "streams as it is generated, and the conversation is kept. Ctrl-D or Ctrl-C at the prompt exits; "
        "Ctrl-C during a reply stops it.",
    )  # fmt: skip
    _add_common_flags(chat, "Send MESSAGE as the one message of the chat, print the reply, and exit.")
    chat.add_argument("--system-prompt", default=None, help="The system message that starts the conversation.")
    chat.set_defaults(func=chat_main)
    complete = subparsers.add_parser(
        "complete", help="Complete prompts with a running server from the terminal.",
        description="Complete prompts with the model of a running OpenAI-compatible server (pagedllm serve): "
        "each completion streams as it is generated. Ctrl-D or Ctrl-C at the prompt exits.",
    )  # fmt: skip
    _add_common_flags(complete, "Complete PROMPT, print the completion, and exit.")
    complete.add_argument(
        "--max-tokens", type=_positive_int, default=None, help="Most tokens per completion (default: the server's)."
    )
    complete.set_defaults(func=complete_main)

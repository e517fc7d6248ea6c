"""OpenAI's error JSON, and the FastAPI exception handlers that always answer with it.

Every error body is ``{"error": {"message", "type", "param", "code"}}``:

=====  ===========================  =================================================
status type                         when
=====  ===========================  =================================================
400    ``invalid_request_error``    a body that does not validate, a bad prompt or
                                    parameter (OpenAI's type; ``code`` is 400, or
                                    ``context_length_exceeded``)
401    ``invalid_request_error``    missing or wrong API key (``code``
                                    ``invalid_api_key``, as OpenAI)
404    ``NotFoundError``            unknown model or route (``code`` 404, as vLLM; a
                                    route's message names the method and path)
405    ``MethodNotAllowedError``    a known route with another method (``Allow`` header)
429    ``requests`` / ``tokens``    a queue limit (``--max-num-queued-reqs`` / ``-tokens``;
                                    ``code`` ``rate_limit_exceeded``, ``Retry-After``)
504    ``timeout_error``            past ``--request-timeout`` (``code`` ``timeout``)
500    ``InternalServerError``      the engine died, or a bug (``code`` 500, as vLLM);
                                    a decode instance whose prefill instance's KV
                                    layout differs (``code`` ``kv_layout_mismatch``)
=====  ===========================  =================================================

Bad input never yields a 500: request handlers raise ``OpenAIServingError`` (see
``bad_request``) and FastAPI's validation errors are turned into 400s here.

Every 4xx answer is logged at INFO with its request id and reason, and carries that id in
its ``X-Request-Id`` header (as OpenAI's responses do): the endpoint's id (``cmpl-...``)
when the request got that far, else the client's ``X-Request-Id``, else a new ``req-...``.
"""

from __future__ import annotations

import logging
import uuid
from http import HTTPStatus
from typing import Any, Optional, Union

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagedllm.engine.exceptions import EngineDeadError, EngineSleepingError
from pagedllm.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger(__name__)

INVALID_REQUEST = "invalid_request_error"

_TYPE_BY_STATUS = {
    400: INVALID_REQUEST,
    401: INVALID_REQUEST,
    404: "NotFoundError",
    405: "MethodNotAllowedError",
    413: INVALID_REQUEST,
    415: INVALID_REQUEST,
    500: "InternalServerError",
    503: "ServiceUnavailableError",
}

#: What the router answers for no route (404) or a route without the method (405).
_ROUTER_STATUSES = (404, 405)

#: Validation errors listed in one message, at most (a union field can yield many).
_MAX_LISTED_ERRORS = 3


class OpenAIServingError(Exception):
    """An error to send to the client as OpenAI's error JSON with ``status_code``."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        err_type: Optional[str] = None,
        param: Optional[str] = None,
        code: Union[int, str, None] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.err_type = err_type or _TYPE_BY_STATUS.get(status_code, "Error")
        self.param = param
        self.code = status_code if code is None else code
        #: The endpoint's id of the request, when it had one (for the log).
        self.request_id: Optional[str] = None
        #: Headers of the answer (e.g. ``Retry-After`` of a 429).
        self.headers: dict[str, str] = {}

    def to_response(self) -> JSONResponse:
        response = error_response(self.status_code, self.message, self.err_type, self.param, self.code)
        response.headers.update(self.headers)
        return response


def bad_request(message: str, param: Optional[str] = None, code: Union[int, str, None] = None) -> OpenAIServingError:
    """A 400 ``invalid_request_error`` (raise it)."""
    return OpenAIServingError(message, 400, INVALID_REQUEST, param, code)


def model_not_found(model: str) -> OpenAIServingError:
    """A 404 for a model this server does not serve (vLLM's message, type and code)."""
    return OpenAIServingError(f"The model `{model}` does not exist.", 404, "NotFoundError", "model", 404)


def from_value_error(exc: ValueError, fields: tuple[str, ...] = ()) -> OpenAIServingError:
    """A 400 for a ``ValueError`` of ``SamplingParams`` or the engine's input checks.

    Their messages start with the offending field's name; when it is one of ``fields``
    it becomes ``param``.
    """
    message = str(exc)
    first_word = message.split(" ", 1)[0]
    return bad_request(message, param=first_word if first_word in fields else None)


def error_body(
    message: str, err_type: str, param: Optional[str] = None, code: Union[int, str, None] = None
) -> dict[str, Any]:
    return ErrorResponse(error=ErrorInfo(message=message, type=err_type, param=param, code=code)).model_dump()


def error_response(
    status_code: int,
    message: str,
    err_type: Optional[str] = None,
    param: Optional[str] = None,
    code: Union[int, str, None] = None,
) -> JSONResponse:
    err_type = err_type or _TYPE_BY_STATUS.get(status_code, "Error")
    body = error_body(message, err_type, param, status_code if code is None else code)
    return JSONResponse(body, status_code=status_code)


def validation_error_message(errors: list[dict[str, Any]]) -> tuple[str, Optional[str]]:
    """(one readable message, the first offending top-level field) of pydantic errors."""
    if not errors:
        return "Invalid request body.", None
    parts = []
    param = None
    for error in errors[:_MAX_LISTED_ERRORS]:
        loc = [str(item) for item in error.get("loc", ())]
        if loc and loc[0] == "body":
            loc = loc[1:]
        msg = str(error.get("msg", "invalid value")).removeprefix("Value error, ")
        if error.get("type") == "json_invalid":
            detail = (error.get("ctx") or {}).get("error")
            msg = f"the body is not valid JSON ({detail})" if detail else "the body is not valid JSON"
            loc = []
        elif error.get("type") in ("missing", "model_attributes_type", "dict_type") and not loc:
            msg = "the body must be a JSON object, sent with Content-Type: application/json"
        if param is None and loc and not loc[0].isdigit():
            param = loc[0]
        parts.append(f"{'.'.join(loc)}: {msg}" if loc else msg)
    if len(errors) > _MAX_LISTED_ERRORS:
        parts.append(f"and {len(errors) - _MAX_LISTED_ERRORS} more")
    return "Invalid request: " + "; ".join(parts), param


def logged_response(
    request: Request, response: JSONResponse, message: str, request_id: Optional[str] = None
) -> JSONResponse:
    """``response`` with its request id in ``X-Request-Id``; a 4xx is logged at INFO."""
    request_id = request_id or request.headers.get("x-request-id") or f"req-{uuid.uuid4().hex}"
    response.headers["X-Request-Id"] = request_id
    if 400 <= response.status_code < 500:
        logger.info(
            "Request %s (%s %s) answered %d: %s",
            request_id, request.method, request.url.path, response.status_code, message,
        )  # fmt: skip
    return response


async def _validation_error_handler(request: Request, exc: RequestValidationError) -> JSONResponse:
    message, param = validation_error_message(list(exc.errors()))
    return logged_response(request, error_response(400, message, INVALID_REQUEST, param), message)


async def _serving_error_handler(request: Request, exc: OpenAIServingError) -> JSONResponse:
    return logged_response(request, exc.to_response(), exc.message, exc.request_id)


def http_error_message(method: str, path: str, exc: StarletteHTTPException) -> str:
    """The message of an HTTP error the router raised: for no route at ``path``, OpenAI's
    "Invalid URL (GET /v1/x)"; for a route without ``method``, the methods it has (its
    ``Allow`` header); any other error's own detail."""
    default = HTTPStatus(exc.status_code).phrase if exc.status_code in _ROUTER_STATUSES else None
    if exc.detail != default:
        return str(exc.detail)
    if exc.status_code == 404:
        return f"Invalid URL ({method} {path})"
    allowed = (exc.headers or {}).get("Allow", "")
    return f"Method Not Allowed ({method} {path}); this route accepts {allowed or 'other methods'}"


async def _http_error_handler(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    message = http_error_message(request.method, request.url.path, exc)
    response = error_response(exc.status_code, message)
    if exc.headers:
        response.headers.update(exc.headers)
    return logged_response(request, response, message)


async def _engine_dead_handler(_: Request, exc: EngineDeadError) -> JSONResponse:
    return error_response(500, f"The engine is dead and cannot serve requests: {exc}")


async def _engine_sleeping_handler(_: Request, exc: EngineSleepingError) -> JSONResponse:
    return error_response(503, str(exc))


async def _unexpected_error_handler(_: Request, exc: Exception) -> JSONResponse:
    logger.exception("Unhandled error while serving a request")
    return error_response(500, f"Internal server error: {type(exc).__name__}: {exc}")


def register_exception_handlers(app: FastAPI) -> None:
    """Answer every error, expected or not, with OpenAI's error JSON."""
    app.add_exception_handler(RequestValidationError, _validation_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(OpenAIServingError, _serving_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(StarletteHTTPException, _http_error_handler)  # type: ignore[arg-type]
    app.add_exception_handler(EngineDeadError, _engine_dead_handler)  # type: ignore[arg-type]
    app.add_exception_handler(EngineSleepingError, _engine_sleeping_handler)  # type: ignore[arg-type]
    app.add_exception_handler(Exception, _unexpected_error_handler)

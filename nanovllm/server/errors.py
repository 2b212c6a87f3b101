"""Every refusal as OpenAI's error object, ``{"error": {"message", "type", "param", "code"}}``, with the status
the OpenAI SDK maps to its exceptions: 400 a bad request (FastAPI's 422 for a body that fails validation is
folded in here), 401 a wrong API key, 404 an unknown model or route, 503 a full queue or a server that is
stopping (with ``Retry-After``), 500 a request the engine failed. Installed on the app by ``install``."""

from __future__ import annotations

import logging
import re
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from nanovllm.server.protocol import FIELD_HINTS

logger = logging.getLogger(__name__)

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 500: "internal_server_error",
          503: "service_unavailable"}
# A ValueError of the engine or SamplingParams starts with the field it is about ("max_tokens must be ...").
_FIELD_AT_START = re.compile(r"^(?:prompts\[\d+\]: )?([a-z_]+)\b")
_UNION_TAG = re.compile(r"^(str|int|float|bool|list\[.*\]|[A-Z]\w*)$")  # "list[int]", "TextPart", ...
_ENGINE_FIELDS = {"prompt", "max_tokens", "temperature", "top_k", "top_p", "seed", "logprobs", "stop_token_ids",
                  "ignore_eos", "priority"}


class OpenAIError(Exception):
    """Raised by a route to answer with the error object: ``status``, ``message``, and the ``param`` it is about."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def response(self) -> JSONResponse:
        return JSONResponse(error_body(self.status, self.message, self.param, self.code), status_code=self.status,
                            headers=self.headers)


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    """OpenAI's error object (also sent as an SSE event when a stream fails midway)."""
    return {"error": {"message": message, "type": _TYPES.get(status, "invalid_request_error"), "param": param,
                      "code": code if code is not None else status}}


def engine_value_error(exc: ValueError, rename: dict[str, str] | None = None) -> OpenAIError:
    """A ``ValueError`` from ``make_request`` / ``SamplingParams`` as a 400 naming its field (``rename`` maps the
    engine's name to the request's: chat asks for ``top_logprobs``, the engine counts ``logprobs``)."""
    message = str(exc)
    match = _FIELD_AT_START.match(message)
    param = match.group(1) if match and match.group(1) in _ENGINE_FIELDS else None
    if param is not None and rename and param in rename:
        message = f"{rename[param]}: {message}"
        param = rename[param]
    return OpenAIError(400, message, param=param)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    """The first problem of a body that failed validation, as one message naming the field."""
    errors = exc.errors()
    if not errors:
        return OpenAIError(400, "invalid request body")
    first = errors[0]
    loc = [str(part) for part in first.get("loc", ()) if part != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(400, f"the body is not valid JSON: {first.get('msg')}"
                                f"{' (' + str(first['ctx']['error']) + ')' if first.get('ctx') else ''}")
    if not loc:  # a check across fields (model_validator): its message starts with "field: "
        message = str(first.get("msg", "")).removeprefix("Value error, ")
        param = message.split(":", 1)[0] if ":" in message else None
        return OpenAIError(400, message, param=param)
    param = loc[0]
    same_field = [e for e in errors if [str(p) for p in e.get("loc", ()) if p != "body"][:1] == [param]]
    # The path as the client wrote it: pydantic adds the union member it tried ("str", "list[int]", ...).
    path = [p for p in loc if not _UNION_TAG.match(p)]
    hinted = next((i for i in range(len(path) - 1, -1, -1) if path[i] in FIELD_HINTS), None)
    if hinted is not None and len(same_field) > 1:  # a value that matches none of a union's types
        message = f"{'.'.join(path[:hinted + 1])}: must be {FIELD_HINTS[path[hinted]]}"
    else:
        message = f"{'.'.join(path)}: {first.get('msg')}"
    return OpenAIError(400, message, param=param)


def install(app: FastAPI) -> None:
    """Route FastAPI's and Starlette's own errors through the error object as well."""

    @app.exception_handler(OpenAIError)
    async def _openai_error(request: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return OpenAIError(exc.status_code, str(exc.detail), headers=getattr(exc, "headers", None)).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error serving %s", request.url.path)
        return OpenAIError(500, f"internal error: {type(exc).__name__}: {exc}").response()

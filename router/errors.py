"""OpenAI-style errors of the router: :class:`APIError` and the app's exception handlers.

Every error answer is ``{"error": {"message", "type", "param", "code"}}``
(:class:`router.schemas.ErrorResponse`): bad input 400, bad API key 401, wrong cluster token
403, unknown route or model 404, a body past the size limit 413, a router at capacity 429,
no healthy worker or a worker failure 503 — never a 500 (an unexpected exception is logged
and answered 503). Every 429 and 503 carries ``Retry-After`` (seconds).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.responses import ErrorInfo, ErrorResponse, validation_error_info

log = logging.getLogger("k3serve.router")

#: ``Retry-After`` (seconds) of a 429 / 503 that names none.
RETRY_AFTER_S = 1


class APIError(Exception):
    """An error answered as ``{"error": {...}}`` with an HTTP status.

    Args:
        status: HTTP status.
        message / type / param / code: the OpenAI error fields.
        retry_after: ``Retry-After`` header, seconds (a 429 or 503 without one gets
            :data:`RETRY_AFTER_S`).
    """

    def __init__(self, status: int, message: str, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None,
                 retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.info = ErrorInfo(message=message, type=type, param=param, code=code)
        if retry_after is None and status in (429, 503):
            retry_after = RETRY_AFTER_S
        self.retry_after = retry_after

    @classmethod
    def invalid(cls, errors: list[Any]) -> APIError:
        """A 400 for pydantic validation errors (``ValidationError.errors()``)."""
        i = validation_error_info(errors)
        return cls(400, i.message, i.type, i.param, i.code)  # type: ignore[arg-type]

    @property
    def message(self) -> str:
        return self.info.message

    def body(self) -> dict[str, Any]:
        """The JSON body."""
        return ErrorResponse(error=self.info).model_dump()

    def response(self) -> JSONResponse:
        headers = {"Retry-After": str(self.retry_after)} if self.retry_after is not None \
            else None
        return JSONResponse(self.body(), status_code=self.status, headers=headers)


def unavailable(message: str) -> APIError:
    """503 ``service_unavailable`` (no healthy worker, no decode room)."""
    return APIError(503, message, "server_error", code="service_unavailable")


def install_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` OpenAI-style (see the module docstring)."""

    @app.exception_handler(APIError)
    async def _api_error(_: Request, e: APIError) -> JSONResponse:
        return e.response()

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, e: RequestValidationError) -> JSONResponse:
        return APIError.invalid(list(e.errors())).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, e: StarletteHTTPException) -> JSONResponse:
        # the status's phrase as the code (404 not_found, 405 method_not_allowed); the
        # exception's headers (a 405's Allow) kept
        try:
            kind = HTTPStatus(e.status_code).phrase.lower().replace(" ", "_")
        except ValueError:
            kind = None
        response = APIError(e.status_code, str(e.detail), code=kind).response()
        response.headers.update(e.headers or {})
        return response

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, e: Exception) -> JSONResponse:
        log.exception("unexpected error: %r", e)
        return APIError(503, f"internal error: {type(e).__name__}", "server_error",
                        code="internal_error").response()

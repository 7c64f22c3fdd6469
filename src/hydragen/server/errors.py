"""Every error the server answers, in OpenAI's shape: ``{"error": {"message", "type", "param", "code"}}``.

``APIError`` carries the status, type and code of one failure class (the table in docs/serving.md);
``install_error_handlers`` makes FastAPI's own 404/405/validation errors and any unexpected exception
answer in the same shape, so no client ever sees ``{"detail": ...}`` or a plain-text 500.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException

INVALID = "invalid_request_error"
SERVER = "server_error"


class APIError(Exception):
    """An error answered in OpenAI's JSON shape with an HTTP status."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status = status
        # Messages may quote client input: never let a lone surrogate make the response unencodable.
        self.message = message.encode("utf-8", "backslashreplace").decode("utf-8")
        self.param = param
        self.type = type_ or (INVALID if status < 500 else SERVER)
        self.code = code
        self.headers = headers

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def note_error(request: Request, err: APIError) -> None:
    """Put the error class into the request's log line (see middleware)."""
    record = request.scope.get("state", {}).get("log")
    if record is not None:
        record.update(error=err.type, code=err.code, param=err.param)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        note_error(request, e)
        return e.response()

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, e: HTTPException):
        method, path = request.method, request.url.path
        if e.status_code == 404:
            err = APIError(404, f"no route for {method} {path}", code="unknown_url")
        elif e.status_code == 405:
            err = APIError(405, f"method {method} is not allowed for {path}", code="method_not_allowed")
        else:
            err = APIError(e.status_code, str(e.detail))
        err.headers = dict(e.headers or {})
        note_error(request, err)
        return err.response()

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request: Request, e: RequestValidationError):
        err = APIError(400, f"invalid request: {e.errors()[0].get('msg', 'invalid') if e.errors() else ''}")
        note_error(request, err)
        return err.response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, e: Exception):
        # Starlette re-raises it after this response is sent, and uvicorn logs the traceback.
        err = APIError(500, f"internal server error: {type(e).__name__}", code="internal_error")
        note_error(request, err)
        return err.response()

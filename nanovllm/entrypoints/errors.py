"""Errors in OpenAI's shape, {"error": {"message", "type", "param", "code"}}, shared by the
server's endpoints."""
import logging

from fastapi.responses import JSONResponse

from nanovllm.entrypoints.engine_loop import EngineDeadError
from nanovllm.entrypoints.protocol import ErrorInfo, ErrorResponse

logger = logging.getLogger("uvicorn.error")  # uvicorn's log: it configures and prints it
MAX_ECHO = 100  # characters of a request's value an error message repeats
MAX_ERROR_MESSAGE = 500
STATUS_TYPES = {400: "invalid_request_error", 401: "invalid_request_error", 404: "invalid_request_error",
                405: "invalid_request_error", 413: "invalid_request_error", 429: "rate_limit_error",
                500: "server_error", 503: "server_error"}


def shorten(text: str, limit: int = MAX_ECHO) -> str:
    """`text` cut to `limit` characters: an error never repeats unbounded input."""
    return text if len(text) <= limit else text[:limit - 1] + "\u2026"


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None,
                 headers: dict | None = None):
        message = shorten(message, MAX_ERROR_MESSAGE)  # messages of SamplingParams and pydantic echo values
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.headers = status, message, param, code, headers

    def body(self) -> ErrorResponse:
        return ErrorResponse(error=ErrorInfo(message=self.message, type=STATUS_TYPES.get(self.status, "server_error"),
                                             param=self.param, code=self.code))

    def response(self) -> JSONResponse:
        return JSONResponse(self.body().model_dump(), status_code=self.status, headers=self.headers)


def engine_error(exc: Exception) -> APIError:
    return APIError(500, str(exc) if isinstance(exc, EngineDeadError) else f"engine error: {exc}", code="engine_error")


def stream_error(exc: Exception) -> APIError:
    """The error a stream sends when it fails midway; logged with its traceback unless the
    engine died (its supervisor says why)."""
    if not isinstance(exc, EngineDeadError):
        logger.exception("a streamed response failed")
    return engine_error(exc)

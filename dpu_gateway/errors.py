"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status.

Handlers raise ``APIError``; a middleware turns it, and aiohttp's own HTTP exceptions (404
route, 405, 413 body too large), into that shape. Anything unexpected becomes a logged 500.
"""

from __future__ import annotations

import re

import msgspec
from aiohttp import web

from shared.log import get_logger
from shared.transport import RingError

log = get_logger("gateway")

_TYPES = {
    400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
    405: "invalid_request_error", 408: "invalid_request_error", 413: "invalid_request_error",
    429: "rate_limit_exceeded",
    500: "internal_server_error", 503: "service_unavailable",
}


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None,
                 retry_after_s: float | None = None, close: bool = False) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.retry_after_s = retry_after_s
        self.close = close  # end the connection after this answer

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": _TYPES.get(self.status, "api_error"),
                          "param": self.param, "code": self.code}}

    def response(self) -> web.Response:
        headers = {}
        if self.retry_after_s is not None:
            headers["Retry-After"] = str(max(1, round(self.retry_after_s)))
        resp = web.Response(status=self.status, body=msgspec.json.encode(self.body()),
                            content_type="application/json", headers=headers)
        if self.close:
            resp.force_close()
        return resp


_PATH = re.compile(r"at `\$\.?([^`]*)`")


def from_decode_error(exc: msgspec.DecodeError) -> APIError:
    """A body msgspec could not decode: invalid JSON, or a field of the wrong type or range."""
    if not isinstance(exc, msgspec.ValidationError):
        return APIError(400, f"request body is not valid JSON: {exc}", code="invalid_json")
    match = _PATH.search(str(exc))
    param = match.group(1) if match else None
    return APIError(400, str(exc), param=param or None, code="invalid_value")


def from_http_exception(exc: web.HTTPException) -> APIError:
    if exc.status == 413:
        return APIError(413, f"request body too large: {exc.text}", code="request_too_large")
    if exc.status == 404:
        return APIError(404, "no such endpoint", code="not_found")
    return APIError(exc.status, exc.reason, code=None)


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except APIError as exc:
        return exc.response()
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        return from_http_exception(exc).response()
    except msgspec.DecodeError as exc:
        return from_decode_error(exc).response()
    except RingError as exc:  # a remote ring lost while the request read it (its watch lets it go next)
        log.warning("ring access failed: 503", path=request.path, error=str(exc))
        return APIError(503, "the engine is not running (its ring cannot be reached)", code="engine_unavailable",
                        retry_after_s=1).response()
    except Exception:
        log.exception("unhandled", path=request.path)
        return APIError(500, "internal server error").response()

"""The HTTP boundary's half of the error taxonomy, and the one place errors become responses.

Kinds that only exist at the HTTP boundary (auth, body size, overload, routing) subclass
shared.errors.ReameError, so every error a client sees comes from one hierarchy and carries
its OpenAI `type`, `code` and status. `error_middleware` turns anything a handler raises into
the OpenAI envelope; an unexpected exception is logged with its traceback and answered with
a plain 500 message, never the traceback itself.
"""
from __future__ import annotations

import logging

from aiohttp import web

from gateway.json_response import json_response
from gateway.request_id import current_request_id
from shared import errors as shared_errors
from shared.errors import InvalidRequestError, ReameError

log = logging.getLogger("reame.gateway")


class AuthenticationError(ReameError, status=401, type="invalid_request_error", code="invalid_api_key"):
    pass


class PermissionDeniedError(ReameError, status=403, type="invalid_request_error", code="permission_denied"):
    """A valid key asked for what only the operator's keys may (gateway.auth.OPERATOR_PATHS)."""


class NotFoundError(InvalidRequestError, status=404, code="not_found"):
    pass


class ModelNotFoundError(NotFoundError, code="model_not_found"):
    pass


class HostNotAllowedError(InvalidRequestError, status=403, code="host_not_allowed"):
    """The Host header names this server by a name it was not configured for (DNS rebinding)."""


class UnsupportedMediaTypeError(InvalidRequestError, status=415, code="unsupported_media_type"):
    pass


class MethodNotAllowedError(InvalidRequestError, status=405, code="method_not_allowed"):
    pass


class RequestTimeoutError(InvalidRequestError, status=408, code="request_timeout"):
    """The client took longer than `read_timeout` to send its request."""


class PayloadTooLargeError(InvalidRequestError, status=413, code="request_too_large"):
    pass


class ConflictError(InvalidRequestError, status=409):
    """The request is valid but the server's state forbids it (e.g. freezing with adaptivity off)."""


class OverloadedError(ReameError, status=429, type="rate_limit_error", code="server_overloaded"):
    retry_after = 1


class ServiceUnavailableError(ReameError, status=503, type="server_error", code="service_unavailable"):
    """No worker is ready (starting, restarting, or all gone)."""
    retry_after = 5


class WorkerLostError(ServiceUnavailableError, code="worker_lost"):
    """The worker running a request died and the request could not be moved elsewhere."""


def error_from_worker(name: str, message: str, param: str | None, code: str | None) -> ReameError:
    """Rebuild the typed error a worker reported by class name (shared.errors or this module).

    A server error's text can hold internals ("generation failed: FloatingPointError: ..."): it
    goes to the log, and the client gets a generic message naming the request id to look for."""
    cls = globals().get(name) or getattr(shared_errors, name, None)
    if not (isinstance(cls, type) and issubclass(cls, ReameError)):
        cls = ReameError
    if cls.status >= 500 and not issubclass(cls, ServiceUnavailableError):
        rid = current_request_id()
        log.error("request %s: worker error %s: %s", rid, name, message)
        message = f"the server failed while generating (request {rid}); its log has the details"
    return cls(message, param=param, code=code)


def error_response(exc: ReameError, headers: dict[str, str] | None = None) -> web.Response:
    headers = dict(headers or {})
    retry_after = getattr(exc, "retry_after", None)
    if retry_after is not None:
        headers["Retry-After"] = str(retry_after)
    response = json_response(exc.to_openai(), exc.status, headers)
    if exc.status == 408:  # the rest of a late body is not worth waiting for: hang up after answering
        response.force_close()
    return response


_HTTP_ERRORS = {
    404: lambda request: NotFoundError(f"{request.method} {request.path} is not a route of this server"),
    405: lambda request: MethodNotAllowedError(f"{request.method} is not allowed on {request.path}"),
    413: lambda request: PayloadTooLargeError("the request body is larger than this server accepts"),
}


@web.middleware
async def error_middleware(request: web.Request, handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except ReameError as exc:
        return error_response(exc)
    except web.HTTPException as exc:
        if exc.status in _HTTP_ERRORS:
            # Keep what the status needs, e.g. the Allow header of a 405 (RFC 9110).
            kept = {k: v for k, v in exc.headers.items() if k.lower() == "allow"}
            return error_response(_HTTP_ERRORS[exc.status](request), kept)
        if exc.status < 400:
            raise
        return error_response(ReameError(exc.reason or "HTTP error") if exc.status >= 500
                              else InvalidRequestError(exc.reason or "bad request"))
    except (ConnectionResetError, OSError) as exc:
        # The client went away mid-response: nothing left to answer.
        log.debug("request %s: %s %s: client connection lost: %s", current_request_id(), request.method,
                  request.path, exc)
        raise
    except Exception:
        log.exception("request %s: %s %s: unhandled error", current_request_id(), request.method, request.path)
        return error_response(ReameError("internal server error"))

"""What every request passes through before its handler: a request id, a bounded body, and an
answer for errors nobody expected.

`RequestIds` (ASGI middleware) gives each HTTP request an id, sent back as `X-Request-Id`; an
exception that escapes a handler is logged with that id and answered with a 500 that names it (a
response already under way is cut short instead; the log still has it). `read_body` reads a body up
to a limit, refusing a larger one with 413 before anything parses it: at once from its
Content-Length, or as soon as a chunked body passes the limit.
"""

from __future__ import annotations

import json
import logging
import uuid

from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response

from specjax.serving.server.protocol import APIError

log = logging.getLogger("specjax.serving.server")


def error_response(exc: APIError) -> Response:
    """The error as OpenAI's JSON body, ASCII-escaped: a message quoting odd client input (a key
    with a lone surrogate) still encodes."""
    return Response(json.dumps(exc.body(), ensure_ascii=True), status_code=exc.status, headers=exc.headers,
                    media_type="application/json")


def request_id(request: Request) -> str:
    """The id `RequestIds` gave this request."""
    return request.scope.get("state", {}).get("request_id", "-")


class RequestIds:
    """ASGI middleware: an id per HTTP request (`X-Request-Id`), and a 500 naming it for an
    exception no handler caught."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        rid = uuid.uuid4().hex
        scope.setdefault("state", {})["request_id"] = rid
        started = False

        async def send_with_id(message):
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message = {**message, "headers": [*message.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_id)
        except ClientDisconnect:  # the client left while sending its body: no one to answer
            log.info("request %s (%s %s): the client disconnected", rid, scope.get("method"), scope.get("path"))
        except Exception:
            log.exception("request %s (%s %s) failed", rid, scope.get("method"), scope.get("path"))
            if started:  # the status is sent: the response is cut short
                return
            err = APIError(500, f"internal error while handling request {rid}; the server's log has the details "
                                "under that id", type="server_error")
            await error_response(err)(scope, receive, send_with_id)


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or 413 when it is longer than `limit` bytes (checked before parsing)."""
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 18 or int(declared) > limit):
        raise _too_large(limit)
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(413, f"the request body is larger than this server's limit of {limit} bytes "
                         "(--max-body-bytes)", code="request_too_large")

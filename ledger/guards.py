"""Refuse a body of the wrong media type before a handler starts reading it.

The OpenAPI document says which operations take ``multipart/form-data``; a
request to one of them with any other ``Content-Type`` is answered 415
(problem+json) instead of failing deep inside the multipart reader, and a
multipart body whose part headers do not parse is a ``malformed`` refusal
(400), not an internal error.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from aiohttp import hdrs, web
from aiohttp.helpers import parse_mimetype
from aiohttp.http_exceptions import HttpProcessingError
from veritrain.protocol.errors import EncodingError

from .openapi import request_media


def _problem(status: int, reason: str, detail: str) -> web.Response:
    body = {"type": f"https://veritrain.dev/problems/{reason}", "title": reason,
            "status": status, "reason": reason, "detail": detail}
    return web.json_response(body, status=status, content_type="application/problem+json")


@web.middleware
async def media_type_middleware(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    resource = request.match_info.route.resource
    if resource is not None and request.method in ("POST", "PUT"):
        wanted = request_media(request.method, resource.canonical)
        if wanted == "multipart/form-data":
            if not request.content_type.startswith("multipart/"):
                return _problem(415, "unsupported_media_type",
                                f"this endpoint takes {wanted}, not {request.content_type}")
            boundary = parse_mimetype(request.headers.get(hdrs.CONTENT_TYPE, "")).parameters.get(
                "boundary", "")
            if not 0 < len(boundary) <= 70:
                return _problem(400, "malformed", "multipart body without a valid boundary")
    try:
        return await handler(request)
    except HttpProcessingError as exc:  # raised by aiohttp's multipart reader on bad input
        raise EncodingError(f"unreadable request body: {exc.message}"[:300]) from exc

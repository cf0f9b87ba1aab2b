"""Who may call ``attnlab serve``: a bearer key (``BearerKey``) and the browser origins allowed
by CORS (``allow_origins``), and the OpenAPI schema it publishes (``document``).

With a key (``--api-key`` or ``ATTNLAB_API_KEY``), every route but ``/health`` answers 401
in OpenAI's error JSON unless the request carries ``Authorization: Bearer <key>``; the key is
compared in constant time (``hmac.compare_digest``), so the time of a refusal does not tell
how much of a guess was right. The check runs before the body is read: a caller without the
key costs no parsing. CORS stays off (browsers on other origins cannot read the answers)
unless ``--allowed-origin`` names the origins that may.
"""

from __future__ import annotations

import hmac
import json
from collections.abc import Sequence

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.openapi.utils import get_openapi
from pydantic import BaseModel

from attnlab.serving.api import error_body

__all__ = ["BearerKey", "allow_origins", "check_key", "document"]

# Open without the key: a load balancer's probe carries no credentials.
OPEN_ROUTES = ("/health",)


class BearerKey:
    """Pure ASGI middleware: 401 for a request without ``Authorization: Bearer <key>``,
    except on ``OPEN_ROUTES`` and for CORS preflights (``OPTIONS``, which browsers send
    without credentials; ``CORSMiddleware``, outside this one, answers them)."""

    def __init__(self, app, *, key: str) -> None:
        self.app, self.expected = app, f"Bearer {check_key(key)}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in OPEN_ROUTES \
                or scope["method"] == "OPTIONS":
            await self.app(scope, receive, send)
            return
        given = dict(scope["headers"]).get(b"authorization", b"")
        if hmac.compare_digest(given, self.expected):
            await self.app(scope, receive, send)
            return
        data = json.dumps(error_body(
            "Incorrect API key provided: expected the header Authorization: Bearer <key>, "
            "with the key this server was started with", code="invalid_api_key")).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(data)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": data})


def check_key(key: object) -> str:
    """``key`` when it is a non-empty string of printable ASCII (what an HTTP header
    carries); else a ``ValueError`` naming ``api_key``."""
    if not isinstance(key, str) or not key or not key.isascii() or not key.isprintable():
        raise ValueError(f"api_key: expected a non-empty string of printable ASCII (it is "
                         f"sent in an HTTP header), got {key!r}")
    return key


def allow_origins(app: FastAPI, origins: Sequence[str]) -> None:
    """Let browser pages of ``origins`` (``"https://app.example"``, or ``"*"``) call the API
    (with the ``Authorization`` header); no origin: CORS off."""
    if origins:
        app.add_middleware(CORSMiddleware, allow_origins=list(origins),
                           allow_methods=["GET", "POST"],
                           allow_headers=["Authorization", "Content-Type"])


def document(app: FastAPI, bodies: dict[str, type[BaseModel]]) -> None:
    """Serve FastAPI's schema of ``app`` with each POST route's request body (``path ->
    model``) as the model validates it: the routes read their bodies themselves (off the
    event loop), so FastAPI cannot see them."""
    def openapi() -> dict:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in bodies.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": {
                        "$ref": f"#/components/schemas/{model.__name__}"}}}}
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi

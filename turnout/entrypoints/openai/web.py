"""The server's web pages: a chat playground at ``/`` and a live ``/dashboard``, plus ``GET /ops``.

The pages are plain files in ``static/`` (no framework, nothing fetched from elsewhere), read once when
the routes are registered and served from memory. They hold no data: the browser fetches it from the
same server with the key typed into the page (``Authorization: Bearer``), so the files may be public
while the data is not. ``/v1/*`` and ``/ops`` are keyed by ``http_guard.RequestGuard`` (``KEYED_PATHS``);
``/metrics`` stays open, as Prometheus scrapers expect (the dashboard sends the key anyway).

``GET /ops`` is the op table this server's engine resolved at start, the rows ``turnout ops --json``
prints (op, chosen implementation, every candidate with why it was or was not taken), so the dashboard
shows what *this* process runs rather than what a fresh resolution on the machine would pick.
"""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from turnout.entrypoints.openai.errors import error_response

_STATIC = "static"
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".svg": "image/svg+xml"}
# Same-origin only: the pages run no inline script and load nothing from another host, and no other
# site may frame them (a framed playground could be driven by clicks the user did not mean).
_HEADERS = {
    "Content-Security-Policy": "default-src 'self'; img-src 'self' data:; style-src 'self'; script-src 'self'; "
                               "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'none'",
    "X-Content-Type-Options": "nosniff",
    "Referrer-Policy": "no-referrer",
    "Cache-Control": "no-cache",
}
PAGES = {"/": "index.html", "/dashboard": "dashboard.html"}


def _load_static() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, media type) for every servable file shipped in the package's static/ folder."""
    out = {}
    for entry in resources.files(__package__).joinpath(_STATIC).iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1] if "." in entry.name else ""
        if entry.is_file() and suffix in _TYPES:
            out[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return out


def ops_payload(state) -> dict:
    """The body of ``GET /ops``: the resolved table plus the platform and policy it was resolved for."""
    table = getattr(state.engine, "ops", None)
    platform = getattr(table, "platform", None)
    policy = getattr(table, "policy", None)
    return {
        "object": "list",
        "phase": state.phase,
        "platform": None if platform is None else {"name": getattr(platform, "name", str(platform)),
                                                   "description": getattr(platform, "description", "")},
        "policy": policy.describe() if hasattr(policy, "describe") else None,
        "data": list(state.ops_report),
    }


def register_web_routes(app: FastAPI, state) -> None:
    """Add ``/``, ``/dashboard``, ``/static/<file>`` and ``/ops`` to ``app`` (called by build_app)."""
    files = _load_static()

    def serve(name: str) -> Response:
        body, media = files[name]
        return Response(body, media_type=media, headers=_HEADERS)

    def page(name: str):
        async def route():  # no parameters: FastAPI would read any as a query field
            return serve(name)
        return route

    for path, name in PAGES.items():
        app.add_api_route(path, page(name), methods=["GET", "HEAD"], include_in_schema=False)

    @app.get("/static/{name}", include_in_schema=False)
    async def static(name: str):
        if name not in files:
            return error_response(404, f"GET /static/{name}: no such file", code="not_found")
        return serve(name)

    @app.get("/ops")
    async def ops():
        return ops_payload(state)

"""The dashboard: a page on the coordinator's API server that shows the swarm and chats with it.

Routes, added to the API's aiohttp app by :meth:`Dashboard.add_routes`:

- ``GET /dashboard`` → redirect to ``/dashboard/``.
- ``GET /dashboard/`` → ``web_peer/dashboard.html``; ``GET /dashboard/NAME.js|.css`` → the
  page's ES modules and style sheet from ``web_peer/`` (public: they hold no secret).
- ``GET /dashboard/state`` → JSON: the coordinator's status document (the same as
  ``colibri-swarm status --json``: peers, plan, events, what the roles measured) plus
  ``generations``, the newest finished generations with their tokens/s, and ``shares``, each
  peer's share of the plan as ``colibri-swarm status`` computes it
  (:func:`swarm.peer.status.shares`). Needs the API's bearer token, as ``/v1/…`` does.

The page is opened as ``https://HOST:PORT/dashboard/#KEY-CODE``: the key code sits in the URL
fragment, which browsers never send to a server. The page derives the API token from it with
WebCrypto HKDF (label ``api-token``, the same derivation as :attr:`SwarmKey.api_token`) and
sends it as the bearer token for the state and for ``POST /v1/chat/completions``.
"""

from __future__ import annotations

import importlib.resources
import re
import time
from collections import deque
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from aiohttp import web

from swarm.peer.status import shares

if TYPE_CHECKING:
    from swarm.compute.textgen import GenerationStats
    from swarm.peer.coordinator.api import ApiServer

PREFIX = "/dashboard/"
GENERATIONS_KEPT = 20  # recent generations shown with their tokens/s
_ASSET = re.compile(r"[a-z0-9_]+\.(js|css)")  # one file of web_peer/, no path
_TYPES = {"js": "text/javascript", "css": "text/css", "html": "text/html"}


def dashboard_url(scheme: str, host: str, port: int, key_code: str) -> str:
    """``SCHEME://HOST:PORT/dashboard/#CODE``: the key in the fragment, never sent to a server."""
    return f"{scheme}://{host}:{port}{PREFIX}#{key_code}"


class Dashboard:
    """The dashboard's routes and the generation meter they report from.

    ``status``: returns the status document (JSON-able dict; ``Node.status``). :meth:`attach`
    mounts the routes on an :class:`~swarm.peer.coordinator.api.ApiServer`, which reports each
    generation's tokens and seconds back.
    """

    def __init__(self, status: Callable[[], dict[str, Any]]) -> None:
        self.status = status
        self.generations: deque[dict[str, Any]] = deque(maxlen=GENERATIONS_KEPT)

    def attach(self, api: ApiServer) -> None:
        """Let ``api`` serve the dashboard (it calls :meth:`add_routes`, :meth:`is_public` and,
        as each generation ends, :meth:`generation_done`)."""
        api.set_dashboard(self)

    def generation_done(self, stats: GenerationStats, seconds: float) -> None:
        """A generation ended (finished or stopped) after ``seconds``: keep its tokens and speed."""
        tokens = int(stats.completion_tokens)
        self.generations.append({
            "t": round(time.time(), 3), "prompt_tokens": int(stats.prompt_tokens),
            "completion_tokens": tokens, "seconds": round(seconds, 4),
            "tokens_per_s": round(tokens / seconds, 3) if seconds > 0 else None})

    @staticmethod
    def is_public(request: web.Request) -> bool:
        """Whether ``request`` asks for the page or one of its files (served without the token)."""
        if request.method not in ("GET", "HEAD"):
            return False
        path = request.path
        return path in ("/dashboard", PREFIX) or (path.startswith(PREFIX) and bool(_ASSET.fullmatch(path[len(PREFIX):])))

    def add_routes(self, app: web.Application) -> None:
        app.router.add_get("/dashboard", self._redirect)
        app.router.add_get(PREFIX, self._page)
        app.router.add_get(PREFIX + "state", self._state)
        app.router.add_get(PREFIX + "{name}", self._asset)

    async def _redirect(self, request: web.Request) -> web.Response:
        raise web.HTTPPermanentRedirect(PREFIX)

    async def _page(self, request: web.Request) -> web.Response:
        return _file_response("dashboard.html")

    async def _asset(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if not _ASSET.fullmatch(name):
            raise web.HTTPNotFound(text=f"no dashboard file {name!r}\n")
        return _file_response(name)

    async def _state(self, request: web.Request) -> web.Response:
        doc = dict(self.status())
        doc["generations"] = list(self.generations)
        ids = [doc.get("peer_id"), *(p.get("peer_id") for p in doc.get("peers") or ())]
        doc["shares"] = shares(doc.get("placement") or {}, ids)  # the page draws them as they are
        return web.json_response(doc, dumps=_dumps, headers={"Cache-Control": "no-store"})


def _dumps(obj: Any) -> str:
    import json

    return json.dumps(obj, default=str)  # as the status file: a summary value must never fail the page


def _file_response(name: str) -> web.Response:
    path = _web_peer_dir() / name
    if not path.is_file():
        raise web.HTTPNotFound(text=f"the dashboard file {name} is not installed (package web_peer)\n")
    return web.Response(body=path.read_bytes(), content_type=_TYPES[name.rsplit(".", 1)[1]], charset="utf-8",
                        headers={"Cache-Control": "no-cache"})


def _web_peer_dir() -> Path:
    return Path(str(importlib.resources.files("web_peer")))

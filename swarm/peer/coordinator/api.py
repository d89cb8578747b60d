"""The coordinator's OpenAI-compatible HTTP API (aiohttp).

Routes (OpenAI API reference, "Chat Completions" and "Models"):

- ``GET  /v1/models`` — the one model this swarm serves.
- ``POST /v1/chat/completions`` — ``stream: false`` answers one ``chat.completion``
  object; ``stream: true`` answers Server-Sent Events, one ``data: {chat.completion.chunk}``
  per text piece, then ``data: [DONE]``.
- ``POST /v1/completions`` — OpenAI's legacy text completion: ``prompt`` (one string) is
  encoded as is, without the chat template (``generate --raw``); ``text_completion`` objects,
  streamed the same way. The other fields are those of chat completions.
- ``GET  /metrics`` — Prometheus text (:mod:`swarm.peer.coordinator.api_metrics`).

A path no route serves (these, the dashboard's) → 404 (``code`` ``unknown_route``, the message
listing the routes), another method on a route's path → 405 (``method_not_allowed``, with
``Allow``), in the error shape below; an unauthenticated request gets the 401 first.

Authentication: ``Authorization: Bearer <token>``, where the token is the swarm key's
``api-token`` sub-key (:attr:`swarm.keys.swarmkey.SwarmKey.api_token`, 64 hex digits, shown by
``colibri-swarm key``). Anything else → 401 — the key code itself too: it would let whoever
reads one request join the swarm.

Transport: HTTPS with a server certificate issued by the swarm's API CA
(:mod:`swarm.peer.coordinator.api_tls`) on any address but loopback; plain HTTP only on loopback or when
asked for explicitly (``tls=False``, ``join --api-plain-http``), which exposes prompts,
replies and the token to the network.

Every request field is validated (:func:`~swarm.peer.coordinator.api_request.parse_chat_request`,
the request model, in ``api_request.py``); a bad one, or one this server does not serve (tools
where the template has no tool format, ``suffix``, unknown fields …: docs/serving.md, "Request fields"), → 400 in
OpenAI's error shape ``{"error": {"message", "type", "param", "code"}}`` naming the field.
``logprobs`` are reported per token (chat: ``choices[].logprobs.content[]``; completions: tokens,
token_logprobs, top_logprobs, text_offset; with ``echo``, the prompt's tokens first, the first
with null), whole and in stream chunks.
``response_format`` (``json_object``, ``json_schema``) is enforced while sampling
(:mod:`swarm.compute.constrain`). ``tools`` and ``tool_choice`` are rendered by the model's chat template and
its ``<tool_call>`` blocks read back as ``tool_calls`` (:mod:`swarm.peer.coordinator.api_tools`). So is a
body that is not JSON, nested too deeply, or not valid Unicode; and a prompt that with
``max_tokens`` does not fit the model's context (checked before any generation).

Generation: continuous batching (:mod:`swarm.compute.serving`, docs/serving.md). The engine
is a :class:`~swarm.peer.coordinator.api_engine.ChatBackend`;
:class:`~swarm.peer.coordinator.api_engine.EngineBackend` hands each request to a
:class:`~swarm.compute.serving.BatchScheduler`, whose one thread runs the forward steps of every
running sequence together — with any FFN backend (``LocalFFN`` here, the coordinator's
``RemoteFFN`` in the swarm) — so the event loop, which also carries the swarm's data channels,
never blocks. Each sequence's tokens are those of its solo run. Up to ``max_batch`` sequences
run, ``max_queue`` more wait; beyond that a request gets ``429`` with ``Retry-After``. A client
that disconnects — mid-prompt too — frees its slot at the end of the step in flight (one log
line, no traceback).
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hmac
import ipaddress
import json
import logging
import threading
import time
import uuid
from collections.abc import AsyncGenerator, Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from swarm.compute.constrain import GrammarError
from swarm.compute.serving import QueueFullError
from swarm.compute.textgen import GenerationStats
from swarm.errors import ChatTemplateError, ContextLengthError, CoordinatorChangedError, LocalProtocolError, SwarmError
from swarm.httpserver import HttpServer
from swarm.peer.coordinator.api_engine import ChatBackend, Piece, TokenLogprob
from swarm.peer.coordinator.api_metrics import CLIENT_GONE, CONTENT_TYPE, ApiMetrics
from swarm.peer.coordinator.api_tools import ToolsNotServed, parse_tool_calls
from swarm.peer.coordinator.api_request import (MAX_BODY_BYTES, ApiError, ChatRequest, StopMatcher, not_served,
                                                parse_chat_request, parse_completion_request)
from swarm.peer.tasks import cancel_and_wait

log = logging.getLogger(__name__)

# A streamed reply sends an SSE comment this often (seconds), whatever else it sends: while it
# waits for a slot or a long prefill, a client then still hears the coordinator, and one that
# hears nothing for longer (swarm.peer.client.STALL_S) knows it is asleep or gone.
KEEPALIVE_S = 2.0
FOLLOW_S = 1.0  # after hand_over(): how often to look for the next coordinator's API until found (s)
FOLLOW_REFRESH_S = 5.0  # … and then, as it may change again (s)
FOLLOW_FIND_S = 1.5  # one mDNS browse (s)

# ---------------------------------------------------------------------------- server

BACKEND = web.AppKey("backend", object)
SERVER = web.AppKey("server", object)
STATS = web.RequestKey("stats", GenerationStats)  # a generation's counts, for the access log
ARRIVED = web.RequestKey("arrived", float)  # time.perf_counter() when the request reached the app
access_log = logging.getLogger("swarm.api.access")


class ApiServer:
    """The aiohttp app and its lifecycle. ``tokens``: accepted bearer tokens (non-empty).

    Use ``port = await server.start(host, port)`` (port 0: any free port) and
    ``await server.close()``; :attr:`scheme` is ``"https"`` or ``"http"`` once started.
    """

    def __init__(self, backend: ChatBackend, tokens: Sequence[str]) -> None:
        if not tokens or not all(tokens):
            raise ValueError("the API needs at least one non-empty bearer token")
        self.backend = backend
        self._tokens = tuple(t.encode() for t in tokens)
        # A reply that cannot be polled (ChatBackend) has a thread that waits on its pieces.
        self._executor = ThreadPoolExecutor(max_workers=max(1, getattr(backend, "concurrency", 1)),
                                            thread_name_prefix="swarm-api-gen")
        # Prompts are encoded beside a running generation, so a bad one is refused at once.
        self._prepare_executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="swarm-api-prepare")
        self._http: HttpServer | None = None
        self._key: Any = None
        self._advertising: asyncio.Task | None = None
        self._handed_back: CoordinatorChangedError | None = None  # set by hand_over()/close(): requests get it
        self._advertised: tuple[str, int] | None = None  # (peer id, term) this server announced on mDNS
        self._following: asyncio.Task | None = None  # after hand_over(): looks for the next coordinator
        self.successor: str | None = None  # the current coordinator's base URL, once hand_over() found it
        self.scheme: str | None = None
        self.generations = 0  # finished or stopped generations, for status
        self.dashboard: Any = None  # a swarm.peer.coordinator.dashboard.Dashboard: set_dashboard()
        self.metrics = ApiMetrics()
        self._loop_waker: _LoopWaker | None = None

    def set_dashboard(self, dashboard: Any) -> None:
        """Serve ``dashboard``'s page and routes (set before :meth:`start`); it is told of each
        generation that ends (``dashboard.generation_done(stats, seconds)``)."""
        self.dashboard = dashboard

    @classmethod
    def for_swarm_key(cls, backend: ChatBackend, key: Any) -> ApiServer:
        """Accept the key's API token only — never the key code (``key``: a
        :class:`~swarm.keys.swarmkey.SwarmKey`); serve HTTPS with a certificate of its API CA."""
        server = cls(backend, [key.api_token])
        server._key = key
        return server

    def app(self) -> web.Application:
        # Outermost first: _no_route runs after authentication, so only a client with the token
        # learns which routes exist.
        app = web.Application(client_max_size=MAX_BODY_BYTES,
                              middlewares=[self._access, self._errors_and_auth, self._no_route])
        app[BACKEND] = self.backend
        app[SERVER] = self
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        app.router.add_post("/v1/completions", self._completions)
        app.router.add_get("/metrics", self._metrics)
        if self.dashboard is not None:
            self.dashboard.add_routes(app)
        return app

    async def start(self, host: str = "0.0.0.0", port: int = 0, ssl_context: Any = None, *,
                    advertise: tuple[str, int] | None = None, tls: bool | None = None) -> int:
        """Serve on ``host:port``; returns the bound port.

        ``tls``: None (default) serves HTTPS unless ``host`` is a loopback address; True always
        HTTPS; False plain HTTP, which on any other address exposes prompts, replies and the
        API token to the network (logged as a warning). HTTPS uses ``ssl_context`` when given,
        else a certificate of the swarm's API CA (:meth:`for_swarm_key`).
        ``advertise=(peer_id, term)``: also announce the API on mDNS
        (:mod:`swarm.discovery.api_record`) so ``chat``/``generate`` on any machine find it
        (needs :meth:`for_swarm_key`). Registration runs in the background; a failure is logged.

        Raises: LocalProtocolError when HTTPS is asked for with neither a context nor a key.
        """
        from swarm.discovery.api_record import local_ipv4_addresses

        addresses = None if host in ("", "0.0.0.0") else [host]
        loopback = _is_loopback(host)
        if ssl_context is None and (tls or (tls is None and not loopback)):
            if self._key is None:
                raise LocalProtocolError("HTTPS needs the swarm key (ApiServer.for_swarm_key) or an ssl_context")
            from swarm.peer.coordinator.api_tls import server_context

            ssl_context = server_context(self._key, addresses or local_ipv4_addresses())
        elif ssl_context is None and not loopback:
            log.warning("the API serves plain HTTP on %s: anyone on this network can read prompts, replies "
                        "and the API token", host or "every address")
        self.scheme = "https" if ssl_context is not None else "http"
        # handler_cancellation: a client that disconnects cancels its handler, which frees its
        # batch slot even while its prompt is still being read (nothing is written then).
        # Request heads are bounded (swarm.httpserver): a head deadline, a cap on waiting connections.
        self._http = HttpServer(self.app(), name="API", handler_cancellation=True)
        bound = await self._http.start(host, port, ssl_context)  # the bound port when 0 was asked
        if advertise is not None and self._key is not None:
            self._advertised = advertise
            self._advertising = asyncio.create_task(self._advertise(*advertise, bound, addresses))
        return bound

    async def _advertise(self, peer_id: str, term: int, port: int, addresses: list[str] | None) -> None:
        from swarm.discovery.api_record import ApiAdvertiser
        from swarm.discovery.mdns import open_zeroconf

        zc = open_zeroconf()
        ad = ApiAdvertiser(zc, swarm_id=self._key.swarm_id, host=peer_id, term=term, port=port,
                           addresses=addresses, scheme=self.scheme)
        try:
            await ad.start()
            await asyncio.Event().wait()  # until close() cancels us
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("could not announce the API on mDNS; clients need --api", exc_info=True)
        finally:
            await asyncio.shield(ad.close())
            await asyncio.shield(zc.async_close())

    async def hand_over(self) -> None:
        """Stop serving as the coordinator, but keep answering at this address: requests in flight
        end at once with :class:`CoordinatorChangedError` (a 503 coded ``coordinator_changed``, or
        an error event in a stream), and so does every authenticated request from now on — naming
        the current coordinator's URL (``coordinator_url``, :attr:`successor`) once its mDNS record
        shows it, so the dashboard and the clients that follow the swarm move there within
        seconds. The mDNS record of this server goes at once; the dashboard's page and files are
        still served. :meth:`close` ends it."""
        self._hand_back(CoordinatorChangedError.stepped_down())
        await self._stop_advertising()
        if self._key is not None and self._following is None:
            self._following = asyncio.create_task(self._follow(), name="API successor")

    async def close(self) -> None:
        """Stop serving: requests in flight end at once with :class:`CoordinatorChangedError`
        (a 503 naming it, or an error event in a stream) rather than run on while the server
        closes, so a client sends them to the current coordinator within a second; then the
        mDNS record goes, then the HTTP server."""
        if self._handed_back is None:
            self._hand_back(CoordinatorChangedError(
                "this peer stopped serving the swarm's API (it stepped down, or it is stopping); "
                "send the request again to the current coordinator"))
        following, self._following = self._following, None
        await cancel_and_wait(following)
        await self._stop_advertising()
        if self._http is not None:
            await self._http.close()
            self._http = None
        self._executor.shutdown(wait=True, cancel_futures=True)
        self._prepare_executor.shutdown(wait=True, cancel_futures=True)

    def _hand_back(self, error: CoordinatorChangedError) -> None:
        """``error`` for every request from now on, and for those admitted now (failed at once)."""
        self._handed_back = error
        fail_all = getattr(self.backend, "fail_all", None)
        if fail_all is not None:
            failed = fail_all(error)
            if failed:
                log.info("API handed %d request(s) in flight back to their clients", failed)

    async def _stop_advertising(self) -> None:
        advertising, self._advertising = self._advertising, None
        await cancel_and_wait(advertising)

    async def _follow(self) -> None:
        """Browse mDNS for the API of another coordinator of this swarm (the newest term):
        every FOLLOW_S until found, then every FOLLOW_REFRESH_S (it may change again)."""
        from swarm.discovery.api_record import find_api
        from swarm.discovery.mdns import open_zeroconf

        own = self._advertised[0] if self._advertised is not None else None
        zc = open_zeroconf()
        try:
            while True:
                try:
                    record = await find_api(self._key.swarm_id, timeout_s=FOLLOW_FIND_S, zc=zc)
                except SwarmError:
                    record = None  # none advertised yet: the election may still be running
                if record is not None and record.host != own:
                    url = record.url.removesuffix("/v1")
                    if url != self.successor:
                        log.info("the swarm's coordinator is now at %s: clients of this address are sent there", url)
                        self.successor = url
                        self._handed_back = CoordinatorChangedError(
                            f"this peer stopped coordinating the swarm; the coordinator is now at {url}",
                            coordinator_url=url)
                await asyncio.sleep(FOLLOW_S if self.successor is None else FOLLOW_REFRESH_S)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.warning("could not look for the next coordinator on mDNS", exc_info=True)
        finally:
            await asyncio.shield(zc.async_close())

    # ------------------------------------------------------------- middleware

    @web.middleware
    async def _access(self, request: web.Request, handler):
        """Count every request and log one line for it: method, path, status, seconds, and a
        generation's tokens (no prompt text). The dashboard's own routes log at DEBUG (it polls)."""
        started = request[ARRIVED] = time.perf_counter()
        status = 500
        try:
            response = await handler(request)
            status = response.status
            return response
        except web.HTTPException as exc:
            status = exc.status
            raise
        except asyncio.CancelledError:
            status = CLIENT_GONE
            raise
        finally:
            seconds = time.perf_counter() - started
            resource = request.match_info.route.resource
            route = resource.canonical if resource is not None else "other"
            self.metrics.request_done(request.method, route, status, seconds)
            stats = request.get(STATS)
            tokens = (f" prompt_tokens={stats.prompt_tokens} completion_tokens={stats.completion_tokens}"
                      if stats is not None else "")
            level = logging.DEBUG if route.startswith("/dashboard") else logging.INFO
            access_log.log(level, "%s %s %s %d %.3f s%s", request.remote, request.method, request.path, status,
                           seconds, tokens)

    @web.middleware
    async def _errors_and_auth(self, request: web.Request, handler):
        try:
            if self.dashboard is not None and self.dashboard.is_public(request):
                return await handler(request)  # the dashboard page and its modules: no secret in them
            header = request.headers.get("Authorization", "")
            scheme, _, token = header.partition(" ")
            token_b = token.strip().encode()
            if scheme.lower() != "bearer" or not any(hmac.compare_digest(token_b, t) for t in self._tokens):
                raise ApiError("Incorrect API key provided: use the swarm's API token (`colibri-swarm key`) "
                               "as the bearer token", status=401, code="invalid_api_key")
            if self._handed_back is not None:  # handed over or closing: the coordinator is elsewhere
                raise self._handed_back
            return await handler(request)
        except ApiError as exc:
            return web.json_response(exc.body(), status=exc.status, headers=exc.headers)
        except SwarmError as exc:  # the engine or the swarm failed this request (e.g. lost its term)
            error = _unavailable(exc)
            return web.json_response(error.body(), status=error.status, headers=error.headers)

    @web.middleware
    async def _no_route(self, request: web.Request, handler):
        """The router's own 404 (no such path) and 405 (no such method on it) as an :class:`ApiError`,
        which :meth:`_errors_and_auth` answers in OpenAI's error shape: clients read every API error
        as JSON. A handler's own HTTP errors (e.g. a dashboard file that is not there) pass unchanged."""
        try:
            return await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed) as exc:
            if exc is not request.match_info.http_exception:
                raise
            if isinstance(exc, web.HTTPMethodNotAllowed):
                allowed = ", ".join(sorted(exc.allowed_methods - {"HEAD"}))  # aiohttp adds HEAD beside each GET
                raise ApiError(f"no route {request.method} {request.path}; it takes {allowed}", status=405,
                               code="method_not_allowed", headers={"Allow": exc.headers["Allow"]}) from None
            raise ApiError(f"no route {request.method} {request.path}; the API serves {_routes(request.app)}",
                           status=404, code="unknown_route") from None

    # ------------------------------------------------------------- routes

    async def _metrics(self, request: web.Request) -> web.Response:
        load = getattr(self.backend, "load", None)
        swarm = getattr(self.backend, "swarm_load", None)
        return web.Response(body=self.metrics.render(load() if load is not None else None,
                                                     swarm() if swarm is not None else None).encode(),
                            headers={"Content-Type": CONTENT_TYPE})

    async def _models(self, request: web.Request) -> web.Response:
        model = {"id": self.backend.model_id, "object": "model", "created": 0, "owned_by": "colibri-swarm"}
        return web.json_response({"object": "list", "data": [model]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        chat = parse_chat_request(await _json_body(request), model_id=self.backend.model_id,
                                  max_tokens_limit=self.backend.max_tokens_limit,
                                  vocab_size=getattr(self.backend, "vocab_size", None))
        return await self._answer(request, chat)

    async def _completions(self, request: web.Request) -> web.StreamResponse:
        chat = parse_completion_request(await _json_body(request), model_id=self.backend.model_id,
                                        max_tokens_limit=self.backend.max_tokens_limit,
                                        vocab_size=getattr(self.backend, "vocab_size", None))
        return await self._answer(request, chat)

    async def _answer(self, request: web.Request, chat: ChatRequest) -> web.StreamResponse:
        """Prepare, then answer ``chat`` as a chat completion, or a text completion when it
        carries a raw ``prompt``; whole or streamed."""
        param = "messages" if chat.prompt is None else "prompt"
        if self._handed_back is not None:  # closing: nothing new starts here
            raise self._handed_back
        loop = asyncio.get_running_loop()
        try:
            chat = await loop.run_in_executor(self._prepare_executor, self.backend.prepare, chat)
        except ContextLengthError as exc:
            raise ApiError(str(exc), param=param, code="context_length_exceeded") from None
        except ChatTemplateError as exc:
            raise ApiError(str(exc), param=param) from None
        except GrammarError as exc:
            raise ApiError(f"'response_format': {exc}", param="response_format") from None
        except ToolsNotServed as exc:
            raise not_served(exc.param, str(exc)) from None
        ident = f"{'chatcmpl' if chat.prompt is None else 'cmpl'}-{uuid.uuid4().hex}"
        created = int(time.time())
        stats = GenerationStats()
        request[STATS] = stats
        if self._handed_back is not None:  # the server began closing while the prompt was encoded
            raise self._handed_back
        try:
            reply = self.backend.generate(chat, stats)  # admitted now, or 429 before any byte is sent
        except QueueFullError as exc:
            raise ApiError(str(exc), status=429, type="rate_limit_error", code="server_busy",
                           headers={"Retry-After": str(exc.retry_after_s)}) from None
        try:
            if chat.stream:
                return await self._stream(request, chat, ident, created, reply, stats)
            texts, tokens = [], []
            async with contextlib.aclosing(self._pieces(chat, stats, reply, request)) as pieces:
                async for piece, piece_tokens in pieces:
                    texts.append(piece)
                    tokens += piece_tokens
            text = "".join(texts)
            tokens = _echoed(reply) + tokens
            message: dict[str, Any] = {"role": "assistant", "content": text}
            finish = stats.finish_reason
            if _parses_tool_calls(chat):
                content, calls = parse_tool_calls(text, chat.tool_format, chat.tools)
                if calls:
                    message = {"role": "assistant", "content": content or None,
                               "tool_calls": [c.openai() for c in calls]}
                    finish = "tool_calls" if finish == "stop" else finish
            echo = (chat.prompt or "") if chat.echo else ""
            choice = {"text": echo + text} if chat.prompt is not None else {"message": message}
            return web.json_response({
                "id": ident, "object": "chat.completion" if chat.prompt is None else "text_completion",
                "created": created, "model": self.backend.model_id,
                "choices": [{"index": 0, **choice, "finish_reason": finish,
                             "logprobs": _logprobs(chat, tokens)}],
                "usage": _usage(stats),
            })
        except asyncio.CancelledError:
            if not chat.stream:
                log.info("client %s went away before its reply after %d token(s); generation stopped",
                         request.remote, stats.completion_tokens)
            raise
        finally:  # the client went away (its handler cancelled) or the reply ended: free the slot
            _cancel(reply)

    async def _stream(self, request: web.Request, chat: ChatRequest, ident: str, created: int,
                      reply: Iterator[str | Piece], stats: GenerationStats) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        beat = asyncio.create_task(_keep_alive(response))
        try:
            await self._stream_events(request, response, chat, ident, created, reply, stats)
        finally:
            await cancel_and_wait(beat)  # before the end: write_eof lets writes through while it drains
        with contextlib.suppress(ConnectionError):  # the client went away (logged above)
            await response.write_eof()
        return response

    async def _stream_events(self, request: web.Request, response: web.StreamResponse, chat: ChatRequest,
                             ident: str, created: int, reply: Iterator[str | Piece],
                             stats: GenerationStats) -> None:
        """The events of :meth:`_stream`'s reply on its prepared ``response``, up to ``[DONE]``
        (the end of the body is :meth:`_stream`'s)."""
        text = chat.prompt is not None  # a text completion: its chunks carry "text", no role or delta
        kind = "text_completion" if text else "chat.completion.chunk"

        def chunk(delta: dict, finish: str | None = None, tokens: Sequence[tuple[int, TokenLogprob]] = ()) -> bytes:
            piece = {"text": delta.get("content", "")} if text else {"delta": delta}
            obj = {"id": ident, "object": kind, "created": created, "model": self.backend.model_id,
                   "choices": [{"index": 0, **piece, "finish_reason": finish,
                                "logprobs": _logprobs(chat, tokens) if tokens else None}]}
            return b"data: " + json.dumps(obj).encode() + b"\n\n"

        # A text piece without logprobs (nearly every chunk): the constant parts encoded once.
        head, _, tail = chunk({"content": _MARK}).partition(json.dumps(_MARK).encode())

        def piece_chunk(piece: str) -> bytes:
            return head + json.dumps(piece).encode() + tail

        try:
            if not text:
                await response.write(chunk({"role": "assistant", "content": ""}))
            elif chat.echo and chat.logprobs is None:
                await response.write(chunk({"content": chat.prompt}))
            echo_due = text and chat.echo and chat.logprobs is not None  # with its tokens, once they are scored
            # aclosing: a client that goes away ends the generation (and frees its slot) now.
            held: list[tuple[str, list[tuple[int, TokenLogprob]]]] = []
            async with contextlib.aclosing(self._pieces(chat, stats, reply, request)) as pieces:
                async for piece, tokens in pieces:
                    if echo_due:
                        echo_due = False
                        await response.write(chunk({"content": chat.prompt}, tokens=_echoed(reply)))
                    if _parses_tool_calls(chat):
                        held.append((piece, tokens))  # calls are read from the whole reply: sent at its end
                    else:
                        await response.write(chunk({"content": piece}, tokens=tokens) if tokens
                                             else piece_chunk(piece))
            if echo_due:  # no text came: the prompt still goes first
                await response.write(chunk({"content": chat.prompt}, tokens=_echoed(reply)))
            finish = stats.finish_reason
            if held:
                content, calls = parse_tool_calls("".join(p for p, _ in held), chat.tool_format, chat.tools)
                every = [t for _, tokens in held for t in tokens]
                if not calls:
                    await response.write(chunk({"content": content}, tokens=every))
                else:
                    if content:
                        await response.write(chunk({"content": content}))
                    await response.write(chunk({"tool_calls": [c.openai(i) for i, c in enumerate(calls)]},
                                               tokens=every))
                    finish = "tool_calls" if finish == "stop" else finish
            await response.write(chunk({}, finish))
            if chat.include_usage:
                obj = {"id": ident, "object": kind, "created": created,
                       "model": self.backend.model_id, "choices": [], "usage": _usage(stats)}
                await response.write(b"data: " + json.dumps(obj).encode() + b"\n\n")
            await response.write(b"data: [DONE]\n\n")
        except (ConnectionError, asyncio.CancelledError) as exc:  # the client went away (a failed write, or
            # its handler cancelled on disconnect): aclosing above already stopped the generation
            log.info("client %s went away mid-stream after %d token(s); generation stopped",
                     request.remote, stats.completion_tokens)
            if isinstance(exc, asyncio.CancelledError):
                raise
        except SwarmError as exc:  # e.g. the coordinator lost its term mid-generation
            error = _unavailable(exc)
            with contextlib.suppress(ConnectionError):
                await response.write(b"data: " + json.dumps(error.body()).encode() + b"\n\ndata: [DONE]\n\n")

    # ------------------------------------------------------------- the token loop

    def _waker(self, loop: asyncio.AbstractEventLoop) -> _LoopWaker:
        """The listener of every reply this server streams on ``loop`` (one per loop)."""
        if self._loop_waker is None or self._loop_waker.loop is not loop:
            self._loop_waker = _LoopWaker(loop)
        return self._loop_waker

    async def _pieces(self, chat: ChatRequest, stats: GenerationStats, reply: Iterator[str | Piece],
                      request: web.Request) -> AsyncGenerator[tuple[str, list[tuple[int, TokenLogprob]]], None]:
        """Text pieces of one admitted generation (``reply``: polled on the loop when the scheduler
        has fed it, or — a reply that cannot be polled — iterated in a worker thread), stop
        strings applied, each with the tokens whose text it ends (``(offset, token)``: where the
        token's text starts in the reply, in characters); a token cut by a stop string goes with
        the text before the cut when some of its text is there."""
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any]] = asyncio.Queue()
        cancel = threading.Event()
        post = lambda kind, value=None: loop.call_soon_threadsafe(queue.put_nowait, (kind, value))  # noqa: E731

        def run() -> None:
            try:
                for piece in reply:
                    post("piece", piece)
                    if cancel.is_set():
                        break
                post("done")
            except BaseException as exc:  # handed to the event loop, raised there
                post("error", exc)
            finally:
                getattr(reply, "close", lambda: None)()

        def deliver() -> None:  # on the event loop, when the scheduler has fed this reply
            try:
                pieces, end = poll()
            except BaseException as exc:  # raised below, as the thread's are
                pieces, end = [], exc
            for piece in pieces:
                queue.put_nowait(("piece", piece))
            if end is True:
                queue.put_nowait(("done", None))
            elif end is not False:
                queue.put_nowait(("error", end))

        stopper = StopMatcher(chat.stop)
        tokens = _TokenOffsets(len(chat.prompt) if chat.echo and chat.prompt is not None else 0)
        started = time.perf_counter()
        first_at: float | None = None
        generated = 0  # tokens the pieces so far end (0: the reply does not say)
        cut_at = 0  # with a stop string: the tokens up to the one that completed it
        poll: Any = getattr(reply, "poll", None)
        listen: Any = getattr(reply, "listen", None)
        future: asyncio.Future | None = None
        if poll is not None and listen is not None:  # no thread: one wake of the loop per step
            listen(self._waker(loop), deliver)
        else:
            future = loop.run_in_executor(self._executor, run)
        try:
            while True:
                kind, value = await queue.get()
                if kind == "error":
                    if isinstance(value, SwarmError):
                        raise value
                    log.error("generation failed", exc_info=value)
                    raise ApiError(f"generation failed: {value!r}", status=500, type="server_error")
                if kind == "done":
                    rest = stopper.flush()
                    tokens.emitted += len(rest)
                    if rest or tokens.pending:
                        yield rest, tokens.release(everything=True)
                    return
                piece = value if isinstance(value, Piece) else Piece(value)
                if first_at is None:
                    first_at = time.perf_counter()
                    self.metrics.first_token(first_at - request[ARRIVED])
                tokens.push(piece)
                generated += piece.generated
                text, stopped = stopper.push(piece.text)
                tokens.emitted += len(text)
                done = tokens.release(stopped=stopped)
                if text or done:
                    yield text, done
                if stopped:
                    stats.finish_reason = "stop"
                    cut_at = generated
                    return
        finally:
            cancel.set()  # a stop string, a client gone, or an error: end the token loop
            if future is None:
                listen(None)
            _cancel(reply)  # wakes the thread even while the prompt is still being read
            if future is not None:
                await asyncio.shield(future)
            if cut_at:  # the reply ends at the cut, not at the tokens its batch ran on meanwhile
                stats.completion_tokens = cut_at
            self.generations += 1
            self.metrics.generation_done(stats.prompt_tokens, stats.completion_tokens,
                                         None if first_at is None else time.perf_counter() - first_at)
            if self.dashboard is not None:  # a stopped generation counts too: its tokens were computed
                self.dashboard.generation_done(stats, time.perf_counter() - started)


_MARK = "\x00piece\x00"  # stands for a chunk's text while its constant parts are encoded


class _LoopWaker:
    """The batch schedulers' way into the event loop: called on a scheduler's thread with the
    ``deliver`` callbacks of the replies a step fed (:meth:`Reply.listen`), it queues them and
    wakes the loop once — not once per reply, nor while a wake is pending — and the loop then
    runs each callback once."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._ready: collections.deque[Callable[[], None]] = collections.deque()
        self._pending = False

    def __call__(self, callbacks: list[Callable[[], None]]) -> None:
        self._ready.extend(callbacks)
        if not self._pending:
            self._pending = True
            try:
                self.loop.call_soon_threadsafe(self._run)
            except RuntimeError:  # the loop is closed: nobody is left to deliver to
                pass

    def _run(self) -> None:
        self._pending = False  # before taking: a callback queued after this wakes the loop again
        ready, due = self._ready, dict[Callable[[], None], None]()
        while ready:
            due[ready.popleft()] = None
        for deliver in due:
            deliver()


def _unavailable(exc: SwarmError) -> ApiError:
    """The 503 for a request the swarm failed; one this peer handed back when it stopped
    coordinating carries ``code`` ``coordinator_changed`` and ``Retry-After: 1``."""
    if isinstance(exc, CoordinatorChangedError):
        extra = {"coordinator_url": exc.coordinator_url} if exc.coordinator_url else None
        return ApiError(str(exc), status=503, type="server_error", code=CoordinatorChangedError.CODE,
                        headers={"Retry-After": "1"}, extra=extra)
    return ApiError(f"generation failed: {exc}", status=503, type="server_error")


def _cancel(reply: Any) -> None:
    """Take ``reply``'s sequence out of the batch (a backend whose replies cannot be cancelled
    stops at its next piece)."""
    getattr(reply, "cancel", lambda: None)()


async def _json_body(request: web.Request) -> Any:
    """The decoded JSON body; ApiError (400, 413) saying what was wrong with it."""
    try:
        return await request.json()
    except web.HTTPRequestEntityTooLarge:
        raise ApiError(f"the request body is larger than {MAX_BODY_BYTES} bytes", status=413) from None
    except RecursionError:
        raise ApiError("the request body nests arrays/objects too deeply to read") from None
    except UnicodeDecodeError as exc:
        raise ApiError(f"the request body is not UTF-8 (byte {exc.start}); send JSON as UTF-8") from None
    except ValueError as exc:  # json.JSONDecodeError, and ints of more than 4300 digits
        raise ApiError(f"the request body is not valid JSON: {exc}") from None


async def _keep_alive(response: web.StreamResponse) -> None:
    """An SSE comment (``: keep-alive``, which clients skip) every :data:`KEEPALIVE_S` on a
    streamed reply, until cancelled or the client is gone. Each write is one transport write,
    so it never splits an event another write sends."""
    with contextlib.suppress(ConnectionError, RuntimeError):  # the client left, or the reply ended
        while True:
            await asyncio.sleep(KEEPALIVE_S)
            await response.write(b": keep-alive\n\n")


def _routes(app: web.Application) -> str:
    """``METHOD path, …`` of every route ``app`` serves, as registered (HEAD, beside each GET, left out)."""
    return ", ".join(f"{route.method} {route.resource.canonical}" for route in app.router.routes()
                     if route.method != "HEAD" and route.resource is not None)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class _TokenOffsets:
    """Where each token of a reply starts in its text, and which tokens the text emitted so far
    (``emitted`` characters, after stop strings) has finished."""

    def __init__(self, start: int = 0) -> None:
        """``start``: where the reply begins in the text (after an echoed prompt)."""
        self.pending: list[tuple[int, int, TokenLogprob]] = []  # (start, end, token) in characters
        self.pushed = start  # characters pushed so far
        self.emitted = start

    def push(self, piece: Piece) -> None:
        """Offsets of ``piece``'s tokens: each starts where the text of those before it in the piece ends."""
        raw = b""
        for i, token in enumerate(piece.tokens):
            start = self.pushed + min(len(raw.decode("utf-8", "ignore")), len(piece.text))
            raw += token.bytes
            end = self.pushed + (len(piece.text) if i == len(piece.tokens) - 1
                                 else min(len(raw.decode("utf-8", "ignore")), len(piece.text)))
            self.pending.append((start, end, token))
        self.pushed += len(piece.text)

    def release(self, *, stopped: bool = False, everything: bool = False) -> list[tuple[int, TokenLogprob]]:
        """The tokens whose text is all emitted (with ``stopped``: whose text starts before the
        cut; the rest never will be); ``everything``: all that remain."""
        if not self.pending:  # a reply without logprobs: no tokens are tracked
            return []
        if everything:
            done = self.pending
        elif stopped:
            done = [p for p in self.pending if p[0] < self.emitted or p[1] == p[0] <= self.emitted]
        else:
            done = [p for p in self.pending if p[1] <= self.emitted]
        self.pending = [] if everything or stopped else self.pending[len(done):]
        return [(start, token) for start, _, token in done]


def _echoed(reply: Any) -> list[tuple[int, TokenLogprob]]:
    """The echoed prompt's tokens with their offsets in it (``(offset, token)``; none unless the
    request echoes its prompt with logprobs)."""
    out, at = [], 0
    for token in getattr(reply, "prompt_logprobs", list)():
        out.append((at, token))
        at += len(token.token)
    return out


def _parses_tool_calls(chat: ChatRequest) -> bool:
    """Whether the reply's tool calls are read back (a chat with tools, and a choice but none)."""
    return chat.prompt is None and bool(chat.tools) and chat.tool_choice != "none"


def _logprobs(chat: ChatRequest, tokens: Sequence[tuple[int, TokenLogprob]]) -> dict[str, Any] | None:
    """OpenAI's ``logprobs`` of a choice for ``tokens`` (``(offset, token)``); None when the
    request asked for none. Chat: ``{"content": [{token, logprob, bytes, top_logprobs}]}``;
    text completions: ``{tokens, token_logprobs, top_logprobs, text_offset}``, whose
    ``top_logprobs`` hold the sampled token too (OpenAI's legacy rule)."""
    if chat.logprobs is None:
        return None
    if chat.prompt is None:
        return {"content": [{"token": t.token, "logprob": t.logprob, "bytes": list(t.bytes),
                             "top_logprobs": [{"token": a, "logprob": lp, "bytes": list(b)} for a, b, lp in t.top]}
                            for _, t in tokens], "refusal": None}
    return {"tokens": [t.token for _, t in tokens], "token_logprobs": [t.logprob for _, t in tokens],
            "top_logprobs": [None if t.logprob is None else {**{a: lp for a, _, lp in t.top}, t.token: t.logprob}
                             for _, t in tokens],  # an echoed prompt's first token: null, as OpenAI's
            "text_offset": [offset for offset, _ in tokens]}


def _usage(stats: GenerationStats) -> dict[str, Any]:
    return {"prompt_tokens": stats.prompt_tokens, "completion_tokens": stats.completion_tokens,
            "total_tokens": stats.prompt_tokens + stats.completion_tokens,
            "prompt_tokens_details": {"cached_tokens": stats.cached_tokens}}

"""Talking to the swarm's coordinator from any machine: ``colibri-swarm chat`` and ``generate --swarm``.

Where the API is, in this order: ``--api URL``; the local peer's status file (``colibri-swarm
join`` running on this machine: its ``api_url``, or its own API port when it coordinates);
the coordinator's mDNS record (:mod:`swarm.discovery.api_record`) — also what a plain
``generate`` on a worker's machine uses, rather than running the model locally. The bearer
token is the stored swarm key's API token, or ``$COLIBRI_SWARM_API_KEY``.

HTTPS is pinned: the only trusted certificate authority is the swarm's API CA, derived from the
stored key (:mod:`swarm.peer.coordinator.api_tls`); without a stored key, the system's trust store
(``SSL_CERT_FILE`` points it at ``api-ca.pem`` written by ``colibri-swarm key``).

Requests use the standard library's HTTP client (a blocking stream is all a terminal needs);
replies stream as Server-Sent Events (:mod:`swarm.peer.coordinator.api`).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import http.client
import json
import os
import ssl
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import CoordinatorChangedError, SwarmError

API_KEY_ENV = "COLIBRI_SWARM_API_KEY"
READ_TIMEOUT_S = 600.0  # socket timeout of a request answered at once
# A streamed reply that sends nothing for this long (seconds; the API sends a comment every
# KEEPALIVE_S, 2 s, even while the request waits for a slot) comes from a coordinator that is
# asleep (a laptop's lid) or gone: the request goes to the coordinator elected meanwhile.
STALL_S = 10.0
RETRY_S = 20.0  # a request whose coordinator went away looks this long for the next one (seconds)
RETRY_PAUSE_S = 0.5  # between attempts to find and reach it (seconds)


class ApiUnavailableError(SwarmError):
    """The coordinator's API could not be reached, dropped the stream midway or handed the
    request back: the request may succeed on the coordinator elected next (see
    :func:`stream_chat_retrying`); ``coordinator_url``: where a deposed one said it is now."""

    def __init__(self, message: str, coordinator_url: str | None = None) -> None:
        super().__init__(message)
        self.coordinator_url = coordinator_url


@dataclass(frozen=True)
class Endpoint:
    """An API base URL (``https://host:port/v1``), its bearer token, and for HTTPS the TLS
    context that pins the swarm's API CA (None: the system's trust store)."""

    url: str
    token: str
    tls: ssl.SSLContext | None = field(default=None, compare=False, repr=False)


def make_endpoint(url: str, token: str) -> Endpoint:
    """An endpoint for ``url`` whose HTTPS trusts only the stored swarm key's API CA."""
    from swarm.keys import swarmkey

    tls = None
    if url.startswith("https://"):
        key = swarmkey.load()
        if key is not None:
            from swarm.peer.coordinator.api_tls import client_context

            tls = client_context(key)
    return Endpoint(url.rstrip("/"), token, tls)


def api_token() -> str:
    token = os.environ.get(API_KEY_ENV)
    if token:
        return token
    from swarm.keys import swarmkey

    key = swarmkey.load()
    if key is None:
        raise SwarmError(f"no swarm key on this machine: run `colibri-swarm join` (the first peer of a swarm "
                         f"makes its key), or `colibri-swarm join --key CODE` once with a running swarm's key "
                         f"(or set {API_KEY_ENV} to the API token shown by `colibri-swarm key`)")
    return key.api_token


def local_peer() -> dict | None:
    """The status document of the peer running on this machine, or None when none runs."""
    try:
        from swarm.peer.status import read_status

        return read_status()
    except (SwarmError, ImportError):
        return None


def api_url_from_status(doc: dict | None = None) -> str | None:
    """The API URL the local peer's status names, if a peer runs here and knows one."""
    doc = local_peer() if doc is None else doc
    if doc is None:
        return None
    url = doc.get("api_url")
    if isinstance(url, str) and url.startswith(("http://", "https://")):
        return url
    placement = doc.get("placement")
    port = placement.get("api_port") if isinstance(placement, dict) else None
    if doc.get("role") == "coordinator" and isinstance(port, int) and 0 < port < 65536:
        scheme = placement.get("api_scheme") if placement.get("api_scheme") in ("http", "https") else "http"
        return f"{scheme}://127.0.0.1:{port}/v1"  # this machine's peer coordinates: its API is here
    return None


def find_endpoint(api: str | None = None, *, mdns: bool = True, token: str | None = None) -> Endpoint | None:
    """Where the coordinator's API is, or None when ``mdns`` is off and nothing closer names one.
    ``token``: the bearer token (default: the stored swarm key's, or ``$COLIBRI_SWARM_API_KEY``).

    Raises:
        SwarmError: no swarm key / token, or (with ``mdns``) no coordinator advertised one.
    """
    token = token or api_token()
    if api:
        return make_endpoint(api, token)
    url = api_url_from_status()
    if url:
        return make_endpoint(url, token)
    if not mdns:
        return None
    from swarm.keys import swarmkey
    from swarm.discovery.api_record import find_api

    key = swarmkey.load()
    if key is None:
        raise SwarmError("no swarm key on this machine to find the swarm by; pass --api URL")
    return make_endpoint(asyncio.run(find_api(key.swarm_id)).url, token)


def request_body(messages: Sequence[Mapping[str, str]], args: argparse.Namespace) -> dict:
    body: dict[str, Any] = {"messages": list(messages), "max_tokens": args.max_tokens,
                            "temperature": args.temperature, "top_p": args.top_p}
    if args.seed is not None:
        body["seed"] = args.seed
    if getattr(args, "top_k", 0):
        body["top_k"] = args.top_k
    return body


def check_reachable(endpoint: Endpoint) -> None:
    """Ask the API for its models once: a REPL then says at its start, not at each turn, that no
    API answers at ``endpoint`` or that it refuses the token. Other answers pass (a coordinator
    that stepped down answers 503 naming the next: a turn meets it).

    Raises:
        ApiUnavailableError: nothing answers there.
        SwarmError: the API refused the token (401, 403; its message is passed on).
    """
    req = urllib.request.Request(f"{endpoint.url}/models", headers={"Authorization": f"Bearer {endpoint.token}"})
    try:
        urllib.request.urlopen(req, timeout=READ_TIMEOUT_S, context=endpoint.tls).close()
    except urllib.error.HTTPError as exc:
        if exc.code in (401, 403):
            raise SwarmError(f"the coordinator's API at {endpoint.url} refused the request: "
                             f"{_error_text(exc, _error_of(exc))}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise _unreachable(endpoint, exc) from None


def stream_chat(endpoint: Endpoint, body: Mapping[str, Any]) -> Iterator[str]:
    """POST ``body`` (with ``stream: true``) and yield the reply's text pieces as they arrive:
    to ``/chat/completions``, or with a raw ``prompt`` instead of ``messages`` to
    ``/completions`` (no chat template).

    Raises:
        SwarmError: the API cannot be reached, refused the request (its message is passed on),
            or the generation failed midway.
    """
    data = json.dumps({**body, "stream": True}).encode()
    route = "completions" if "prompt" in body else "chat/completions"
    req = urllib.request.Request(f"{endpoint.url}/{route}", data=data, method="POST", headers={
        "Content-Type": "application/json", "Authorization": f"Bearer {endpoint.token}",
        "Accept": "text/event-stream"})
    try:
        response = urllib.request.urlopen(req, timeout=STALL_S, context=endpoint.tls)
    except urllib.error.HTTPError as exc:
        error = _error_of(exc)
        message = f"the coordinator's API at {endpoint.url} refused the request: {_error_text(exc, error)}"
        if error.get("code") == CoordinatorChangedError.CODE:  # it stepped down: the next one may answer
            raise ApiUnavailableError(message, _url_of(error)) from None
        raise SwarmError(message) from None
    except (urllib.error.URLError, OSError) as exc:
        raise _unreachable(endpoint, exc) from None
    with response:
        yield from _read_events(endpoint, response)


def _read_events(endpoint: Endpoint, response: Any) -> Iterator[str]:
    try:
        for raw in response:
            line = raw.decode("utf-8", "replace").strip()
            if not line.startswith("data:"):
                continue
            payload = line[5:].strip()
            if payload == "[DONE]":
                return
            try:
                event = json.loads(payload)
            except ValueError:
                raise SwarmError(f"the API at {endpoint.url} sent a malformed event: {payload[:80]!r}") from None
            if "error" in event:
                error = event["error"] if isinstance(event["error"], dict) else {}
                if error.get("code") == CoordinatorChangedError.CODE:  # handed back: ask the next coordinator
                    raise ApiUnavailableError(f"the coordinator at {endpoint.url} handed the request back: "
                                              f"{error.get('message')}", _url_of(error))
                raise SwarmError(f"the swarm failed the request: {error.get('message')}")
            for choice in event.get("choices") or ():
                piece = choice.get("text") or (choice.get("delta") or {}).get("content")
                if piece:
                    yield piece
    except TimeoutError:  # nothing, not even a keep-alive, for STALL_S: asleep or gone
        raise ApiUnavailableError(f"the API at {endpoint.url} sent nothing for {STALL_S:g} s (its coordinator "
                                  "asleep or gone)") from None
    except (OSError, http.client.HTTPException) as exc:  # the coordinator went away mid-reply
        raise ApiUnavailableError(f"the API at {endpoint.url} broke off the stream: {exc!r}") from None
    raise ApiUnavailableError(f"the API at {endpoint.url} closed the stream before it finished")


def stream_chat_retrying(endpoint: Endpoint, body: Mapping[str, Any], *, rediscover: bool = True,
                         retry_s: float = RETRY_S, on_retry: Any = None) -> Iterator[str]:
    """:func:`stream_chat`, but when the coordinator goes away midway (the API unreachable or the
    stream broken off) the request is sent again to the coordinator found next (the local peer's
    status or mDNS) for up to ``retry_s`` seconds. The reply is yielded once: the text already
    yielded is skipped in the new reply, which must start with it (a greedy or seeded request
    does). ``on_retry(error)`` is called once per outage, before the search for the next one.
    ``rediscover=False`` (the user named the API with ``--api``: there is no next coordinator to
    look for) fails at the first unreachable API or broken stream instead.

    Raises:
        SwarmError: as :func:`stream_chat`; also when no coordinator answered within ``retry_s``,
            or the new reply differs from the text already yielded (sampling without a seed).
    """
    shown, deadline = "", None
    while True:
        produced = ""
        try:
            for piece in stream_chat(endpoint, body):
                produced += piece
                if not (shown.startswith(produced) or produced.startswith(shown)):
                    raise SwarmError("the new coordinator's reply differs from the text already shown "
                                     "(sampling without --seed); ask again")
                if len(produced) > len(shown):
                    deadline = None  # new text: a later outage gets a window of its own
                    new, shown = produced[len(shown):], produced
                    yield new
            return
        except ApiUnavailableError as exc:
            if not rediscover:
                raise SwarmError(str(exc)) from None
            now = time.monotonic()
            if deadline is None:
                deadline = now + retry_s
                if on_retry is not None:
                    on_retry(exc)
            elif now >= deadline:
                raise SwarmError(f"{exc}; no coordinator answered within {retry_s:g} s") from None
            if exc.coordinator_url is not None and exc.coordinator_url.split(":")[0] == endpoint.url.split(":")[0]:
                # the deposed coordinator said where the swarm's API is now (the same scheme only:
                # HTTPS stays pinned to the swarm's CA, the token never goes out in plain HTTP)
                endpoint = dataclasses.replace(endpoint, url=f"{exc.coordinator_url}/v1")
                time.sleep(RETRY_PAUSE_S)
            else:
                endpoint = _next_endpoint(endpoint)


def _next_endpoint(last: Endpoint) -> Endpoint:
    """The coordinator's API as found now; ``last`` while nothing answers."""
    time.sleep(RETRY_PAUSE_S)
    try:
        found = find_endpoint(None, mdns=True, token=last.token)
    except SwarmError:
        return last  # no record yet: the election may still be running; the caller tries again
    return found if found is not None else last


def _url_of(error: dict) -> str | None:
    """The ``coordinator_url`` a deposed coordinator's error names, if it is an HTTP(S) base URL."""
    url = error.get("coordinator_url")
    if isinstance(url, str) and url.startswith(("https://", "http://")) and len(url) < 256 and url.isprintable():
        return url.rstrip("/")
    return None


def _unreachable(endpoint: Endpoint, exc: BaseException) -> ApiUnavailableError:
    return ApiUnavailableError(f"cannot reach the coordinator's API at {endpoint.url}: "
                               f"{getattr(exc, 'reason', exc)}; is `colibri-swarm join` running?")


def _error_of(exc: urllib.error.HTTPError) -> dict:
    """The OpenAI ``error`` object of a refused request's body ({} when it has none)."""
    try:
        error = json.loads(exc.read())["error"]
    except (ValueError, KeyError, TypeError, OSError):
        return {}
    return error if isinstance(error, dict) else {}


def _error_text(exc: urllib.error.HTTPError, error: dict) -> str:
    message = error.get("message")
    return f"{exc.code} {message}" if isinstance(message, str) else f"HTTP {exc.code} {exc.reason}"

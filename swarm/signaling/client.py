"""The signaling client Python peers use: authenticate, learn presence, exchange signals.

Usage (interface for ``swarm.peer``)::

    client = await SignalingClient.connect(url, swarm_key, peer_id, kind="python", name="laptop",
                                           fingerprint=record.fingerprint)  # pinned, from mDNS TXT
    client.peers                      # {peer_id: PeerInfo}, kept current, includes this peer
    await client.send_signal(other_id, {"sdp": ..., "type": "offer"})
    async for event in client:        # PeerJoined, PeerLeft, SignalReceived, then Disconnected last
        ...
    await client.close()

TLS is checked by pinning the SHA-256 of the server's certificate (there is no CA on a LAN);
with ``fingerprint=None`` (``--signal URL`` typed by hand) the certificate is not checked and
the server's HMAC proof of the swarm key is what authenticates it. Either way the server must
prove the key before :meth:`SignalingClient.connect` returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from swarm import paths
from swarm.errors import (
    AuthenticationError,
    DuplicatePeerError,
    RemoteProtocolError,
    SignalingUnavailableError,
    SwarmError,
    VersionMismatchError,
)
from swarm.signaling import auth, tls
from swarm.signaling.address import SignalAddress
from swarm.signaling.messages import (
    Auth,
    Challenge,
    Joined,
    Left,
    Notice,
    PeerInfo,
    Relayed,
    Signal,
    Welcome,
    decode_server_message,
)
from swarm.signaling.relay import MAX_FRAME_CHARS, CloseCode

log = logging.getLogger(__name__)

CONNECT_TIMEOUT_S = 10.0
HEARTBEAT_S = 5.0
# Sent with every auth: the server tells our own reconnects (same instance) from another process
# that claims our peer id (a copied identity), which it refuses.
PROCESS_INSTANCE = secrets.token_hex(8)


@dataclass(frozen=True)
class PeerJoined:
    """A peer authenticated at the server."""

    peer: PeerInfo


@dataclass(frozen=True)
class PeerLeft:
    """A peer's signaling connection ended."""

    peer_id: str


@dataclass(frozen=True)
class SignalReceived:
    """A signal from ``sender`` (stamped by the server): an SDP offer/answer, ICE candidate, …"""

    sender: str
    data: dict[str, Any]


@dataclass(frozen=True)
class SignalRefused:
    """The server could not deliver a signal (``code`` e.g. ``unknown-peer``)."""

    code: str
    detail: str


@dataclass(frozen=True)
class Disconnected:
    """The connection ended; always the last event. ``code``/``reason`` from the close frame if any."""

    code: int | None
    reason: str


Event = PeerJoined | PeerLeft | SignalReceived | SignalRefused | Disconnected


def signaling_url(url: str) -> str:
    """``wss://HOST:PORT/ws`` for any form :class:`~swarm.signaling.address.SignalAddress` parses
    (``HOST:PORT``, ``https://HOST:PORT``, ``wss://HOST:PORT/ws``); AddressError otherwise."""
    return SignalAddress.parse(url).ws_url


def _ssl_for(fingerprint: bytes | str | None) -> aiohttp.Fingerprint | bool:
    if fingerprint is None:
        return False
    if isinstance(fingerprint, str):
        fingerprint = tls.parse_fingerprint(fingerprint)
    return aiohttp.Fingerprint(fingerprint)


async def fetch_status(url: str, fingerprint: bytes | str | None = None,
                       timeout: float = CONNECT_TIMEOUT_S) -> dict[str, Any]:
    """GET ``/api/status`` of the server at ``url`` (any form :func:`signaling_url` takes).

    Returns the JSON object (see SignalingServer.status). Raises SignalingUnavailableError when
    the server cannot be reached, its certificate is not the pinned one, or the answer is not JSON.
    """
    status_url = SignalAddress.parse(url).status_url
    try:
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout)) as session:
            async with session.get(status_url, ssl=_ssl_for(fingerprint)) as resp:
                resp.raise_for_status()
                status = await resp.json()
    except (aiohttp.ClientError, asyncio.TimeoutError, OSError, ValueError) as exc:
        raise SignalingUnavailableError(f"no status from {status_url}: {exc or type(exc).__name__}") from None
    if not isinstance(status, dict):
        raise SignalingUnavailableError(f"{status_url} did not answer with a JSON object")
    return status


class SignalingClient:
    """One authenticated signaling connection. Create with :meth:`connect`."""

    def __init__(self, session: aiohttp.ClientSession, ws: aiohttp.ClientWebSocketResponse,
                 peer_id: str, host: str, peers: tuple[PeerInfo, ...]) -> None:
        self.peer_id = peer_id
        self.host = host  # the hosting peer's id, from the challenge
        self.peers: dict[str, PeerInfo] = {p.peer_id: p for p in peers}
        self._session = session
        self._ws = ws
        self._events: asyncio.Queue[Event | None] = asyncio.Queue()
        self._reader = asyncio.create_task(self._read(), name=f"signaling-client-{peer_id[:8]}")
        self.closed = asyncio.Event()

    @classmethod
    async def connect(cls, url: str, swarm_key: bytes, peer_id: str, *, kind: str = "python", name: str = "",
                      fingerprint: bytes | str | None = None, timeout: float = CONNECT_TIMEOUT_S,
                      instance: str = PROCESS_INSTANCE) -> SignalingClient:
        """Connect, prove the swarm key, check the server's proof, return with presence known.

        ``instance``: this process's random tag (see :data:`PROCESS_INSTANCE`); two peers that
        share a peer id must pass different ones to be told apart.
        Raises SignalingUnavailableError (unreachable, TLS pin mismatch), AuthenticationError
        (wrong key either side), DuplicatePeerError (another process holds our peer id there),
        RemoteProtocolError (malformed server frames), AddressError (``url`` malformed).
        """
        k_sig = auth.derive_signaling_key(swarm_key)
        url = signaling_url(url)
        session = aiohttp.ClientSession()
        try:
            return await asyncio.wait_for(
                cls._handshake(session, url, k_sig, peer_id, kind, name, _ssl_for(fingerprint), instance),
                timeout)
        except asyncio.TimeoutError:
            await session.close()
            raise SignalingUnavailableError(f"signaling server at {url} did not answer within {timeout:g} s") from None
        except BaseException:
            await session.close()
            raise

    @classmethod
    async def _handshake(cls, session: aiohttp.ClientSession, url: str, k_sig: bytes, peer_id: str,
                         kind: str, name: str, ssl: Any, instance: str) -> SignalingClient:
        try:
            ws = await session.ws_connect(url, ssl=ssl, heartbeat=HEARTBEAT_S, max_msg_size=2 * MAX_FRAME_CHARS,
                                          compress=0)
        except aiohttp.ServerFingerprintMismatch:
            raise SignalingUnavailableError(
                f"the certificate at {url} is not the one advertised (fingerprint mismatch)") from None
        except (aiohttp.ClientError, OSError) as exc:
            raise SignalingUnavailableError(f"cannot reach the signaling server at {url}: {exc}") from None
        try:
            challenge = decode_server_message(await _receive_text(ws))
            if not isinstance(challenge, Challenge):
                raise RemoteProtocolError("signaling server did not start with a challenge")
            client_nonce = auth.new_nonce()
            mac = auth.client_mac(k_sig, challenge.nonce, client_nonce, peer_id)
            await ws.send_str(Auth(peer_id=peer_id, kind=kind, name=name, nonce=client_nonce, mac=mac,
                                   instance=instance).encode())
            welcome = decode_server_message(await _receive_text(ws, peer_id))
            if not isinstance(welcome, Welcome):
                raise RemoteProtocolError("signaling server did not answer the authentication with a welcome")
            auth.verify(auth.server_mac(k_sig, challenge.nonce, client_nonce, peer_id), welcome.mac, "signaling server")
        except (aiohttp.ClientError, OSError) as exc:  # the connection broke mid-handshake
            with contextlib.suppress(Exception):
                await ws.close()
            raise SignalingUnavailableError(f"signaling server at {url} dropped the connection: {exc!r}") from None
        except BaseException:
            with contextlib.suppress(Exception):
                await ws.close()
            raise
        return cls(session, ws, peer_id, challenge.host, welcome.peers)

    # -- use -------------------------------------------------------------------------------

    async def send_signal(self, to: str, data: dict[str, Any]) -> None:
        """Send ``data`` (a JSON object) to peer ``to``. Raises SignalingUnavailableError when closed."""
        if self._ws.closed:
            raise SignalingUnavailableError("signaling connection is closed")
        text = Signal(to=to, data=data).encode()
        if len(text) > MAX_FRAME_CHARS:
            raise SwarmError(f"signal of {len(text)} bytes exceeds the {MAX_FRAME_CHARS}-byte frame limit")
        try:
            await self._ws.send_str(text)
        except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
            raise SignalingUnavailableError(f"signaling connection lost: {exc}") from None

    def __aiter__(self) -> AsyncIterator[Event]:
        return self

    async def __anext__(self) -> Event:
        event = await self._events.get()
        if event is None:
            self._events.put_nowait(None)  # keep later iterations ending too
            raise StopAsyncIteration
        return event

    async def close(self) -> None:
        """Close the connection (normal closure) and wait for the reader to end."""
        with contextlib.suppress(Exception):
            await self._ws.close()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await self._reader
        with contextlib.suppress(Exception):
            await self._session.close()

    async def wait_closed(self) -> None:
        await self.closed.wait()

    # -- reader ----------------------------------------------------------------------------

    async def _read(self) -> None:
        code, reason = None, ""
        try:
            while True:
                msg = await self._ws.receive()
                if msg.type == aiohttp.WSMsgType.CLOSE:
                    code, reason = msg.data, str(msg.extra or "")
                    break
                if msg.type != aiohttp.WSMsgType.TEXT:
                    break  # CLOSED / ERROR / binary: the server does not send binary
                try:
                    event = self._on_message(decode_server_message(msg.data))
                except RemoteProtocolError as exc:
                    log.warning("signaling server sent a bad frame: %s", exc)
                    code, reason = CloseCode.PROTOCOL_ERROR, str(exc)
                    await self._ws.close(code=code, message=reason[:123].encode())
                    break
                if event is not None:
                    self._events.put_nowait(event)
        except Exception as exc:  # e.g. aiohttp's pong on a closing socket after a stall: the end, not a crash
            log.info("signaling connection failed: %r", exc)
            reason = repr(exc)[:123]
        finally:
            if code is None:
                code = self._ws.close_code
            self._events.put_nowait(Disconnected(code, reason))
            self._events.put_nowait(None)
            self.closed.set()

    def _on_message(self, msg: Any) -> Event | None:
        match msg:
            case Joined(peer=peer):
                self.peers[peer.peer_id] = peer
                return PeerJoined(peer)
            case Left(peer_id=peer_id):
                self.peers.pop(peer_id, None)
                return PeerLeft(peer_id)
            case Relayed(sender=sender, data=data):
                return SignalReceived(sender, data)
            case Notice(code=code, detail=detail):
                return SignalRefused(code, detail)
            case _:
                raise RemoteProtocolError(f"unexpected {type(msg).__name__} after authentication")


async def _receive_text(ws: aiohttp.ClientWebSocketResponse, peer_id: str = "") -> str:
    msg = await ws.receive()
    if msg.type == aiohttp.WSMsgType.TEXT:
        return msg.data
    if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED):
        code = msg.data if msg.type == aiohttp.WSMsgType.CLOSE else ws.close_code
        reason = str(msg.extra or "") if msg.type == aiohttp.WSMsgType.CLOSE else ""
        if code == CloseCode.AUTH_FAILED:
            raise AuthenticationError(f"the signaling server refused our swarm key ({reason}); "
                                      "check the key with `colibri-swarm key`")
        if code == CloseCode.VERSION_MISMATCH:
            raise VersionMismatchError(reason)
        if code == CloseCode.DUPLICATE_PEER:
            raise DuplicatePeerError(
                f"another machine uses this peer identity {peer_id} ({reason}; a copied config directory or a "
                f"cloned VM?): delete {paths.identity_file()} on this machine to give it its own identity")
        raise SignalingUnavailableError(f"signaling server closed the connection ({code} {reason})")
    raise RemoteProtocolError(f"signaling server sent a {msg.type.name} frame where text was expected")

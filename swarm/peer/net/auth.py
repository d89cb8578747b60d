"""Channel authentication: proves, over a fresh data channel, that both ends hold the swarm key
and see the same two DTLS certificates.

Theory of operation (byte layout in docs/protocol.md, "Channel authentication"). WebRTC's DTLS
encrypts the channel, but the certificates it checks come from SDP relayed by the signaling
server, which we do not trust. So each side, as soon as the channel opens, sends
:class:`~swarm.peer.net.messages.AuthHello` (its peer id and a fresh 32-byte nonce). When it has the
other's hello it knows the whole transcript — ordered by SDP role (offerer first), not by
local/remote, so both sides build the same bytes — and sends :class:`AuthProof` with two
HMAC-SHA256 values keyed by the swarm key's ``channel-auth`` sub-key:

* ``key_mac`` over the transcript without the fingerprints: proves the key;
* ``channel_mac`` over the transcript with both DTLS fingerprints: binds the channel.

The receiver compares both in constant time. A wrong ``key_mac`` means a wrong swarm key; a
right ``key_mac`` with a wrong ``channel_mac`` means the two ends saw different certificates:
a relay substituted a fingerprint. Either raises :class:`~swarm.errors.AuthenticationError`
naming the check. Each MAC carries the sender's role, so a proof cannot be reflected back.
Before both proofs are through, any other message on the channel is an error.

States: ``HELLO_SENT`` → (remote hello) ``PROOF_SENT`` → (remote proof ok) ``DONE``; any
error → ``FAILED``. Sans-I/O: frames and ``now`` in, frames out; the adapter sends them.
"""

from __future__ import annotations

import hmac
import os
import re
from enum import Enum
from hashlib import sha256

from swarm.errors import AuthenticationError, LocalProtocolError
from swarm.peer.net import messages, wire
from swarm.peer.net.messages import AuthHello, AuthProof

AUTH_TIMEOUT_S = 10.0  # seconds from start until both proofs must be through
NONCE_BYTES = 32
MAX_HANDSHAKE_FRAME_BYTES = 4096  # handshake frames are ~200 bytes; nothing bigger before auth
TRANSCRIPT_HEADER = "colibri-swarm channel-auth v1\n"

_FINGERPRINT_RE = re.compile(r"[0-9A-F]{2}(?::[0-9A-F]{2}){31}")


class Role(str, Enum):
    """Which side of the SDP exchange this peer was; fixes the transcript order."""

    OFFERER = "offerer"
    ANSWERER = "answerer"


class State(Enum):
    HELLO_SENT = "hello-sent"
    PROOF_SENT = "proof-sent"
    DONE = "done"
    FAILED = "failed"


def normalize_fingerprint(fingerprint: str) -> str:
    """``"sha-256 AB:CD:…"`` (SDP ``a=fingerprint`` form: algorithm lower case, hex upper case).

    Accepts any case and an optional ``a=fingerprint:`` prefix; only sha-256 is used.
    Raises AuthenticationError for anything else (it usually comes from remote SDP).
    """
    text = fingerprint.strip()
    if text.lower().startswith("a=fingerprint:"):
        text = text[len("a=fingerprint:") :]
    parts = text.split()
    if len(parts) != 2 or parts[0].lower() != "sha-256" or not _FINGERPRINT_RE.fullmatch(parts[1].upper()):
        raise AuthenticationError(f"DTLS fingerprint {fingerprint!r:.120} is not 'sha-256' and 32 hex bytes with colons")
    return f"sha-256 {parts[1].upper()}"


def transcript(
    *,
    offer_peer_id: str,
    answer_peer_id: str,
    offer_nonce: str,
    answer_nonce: str,
    offer_fingerprint: str | None,
    answer_fingerprint: str | None,
    protocol_version: int = wire.PROTOCOL_VERSION,
) -> bytes:
    """The common transcript lines (ASCII); fingerprints omitted when None (the key-only form)."""
    lines = [
        f"protocol-version={protocol_version}",
        f"offer-peer-id={offer_peer_id}",
        f"answer-peer-id={answer_peer_id}",
        f"offer-nonce={offer_nonce}",
        f"answer-nonce={answer_nonce}",
    ]
    if offer_fingerprint is not None and answer_fingerprint is not None:
        lines += [f"offer-fingerprint={offer_fingerprint}", f"answer-fingerprint={answer_fingerprint}"]
    return "".join(line + "\n" for line in lines).encode("ascii")


def mac(auth_key: bytes, proof: str, role: Role, common: bytes) -> str:
    """HMAC-SHA256 (RFC 2104) of ``header + "proof=<proof>\\nrole=<role>\\n" + common``, lower-case hex.

    ``proof`` is ``"key"`` (common without fingerprints) or ``"channel"`` (with them).
    """
    data = f"{TRANSCRIPT_HEADER}proof={proof}\nrole={role.value}\n".encode("ascii") + common
    return hmac.new(auth_key, data, sha256).hexdigest()


class ChannelAuth:
    """One side of the handshake on one data channel.

    ``auth_key``: the swarm key's channel-auth sub-key (``SwarmKey.channel_auth_key``, 32 bytes).
    ``local_fingerprint``: of our DTLS certificate; ``remote_fingerprint``: from the remote SDP.
    ``now``: seconds on the caller's monotonic clock; ``nonce``: 32 bytes (random by default).
    ``expected_peer_id``: when the adapter knows which peer id the remote must be (the one
    signaling stamped on its signals), a hello claiming another is refused. That a Python peer's
    id is the hash of its DTLS certificate key is checked by the adapter once DTLS is up
    (:mod:`swarm.peer.net.link`).
    """

    def __init__(
        self,
        *,
        role: Role,
        auth_key: bytes,
        local_peer_id: str,
        local_fingerprint: str,
        remote_fingerprint: str,
        now: float,
        nonce: bytes | None = None,
        timeout_s: float = AUTH_TIMEOUT_S,
        expected_peer_id: str | None = None,
    ) -> None:
        if len(auth_key) < 32:
            raise LocalProtocolError("channel-auth key must be 32 bytes (SwarmKey.channel_auth_key)")
        self.role = Role(role)
        self._key = auth_key
        self.local_peer_id = local_peer_id
        self.local_fingerprint = normalize_fingerprint(local_fingerprint)
        self.remote_fingerprint = normalize_fingerprint(remote_fingerprint)
        nonce = os.urandom(NONCE_BYTES) if nonce is None else nonce
        if len(nonce) != NONCE_BYTES:
            raise LocalProtocolError(f"nonce must be {NONCE_BYTES} bytes")
        self.local_nonce = nonce.hex()
        self.remote_peer_id: str | None = None
        self.expected_peer_id = expected_peer_id
        self._remote_nonce: str | None = None
        self.deadline = now + timeout_s
        self.state = State.HELLO_SENT
        self._hello = messages.encode(AuthHello(peer_id=local_peer_id, nonce=self.local_nonce))

    @property
    def authenticated(self) -> bool:
        return self.state is State.DONE

    def start(self) -> list[bytes]:
        """The frames to send when the channel opens (our AuthHello)."""
        return [self._hello]

    def receive(self, data: bytes | bytearray | memoryview) -> list[bytes]:
        """Feed one whole frame from the remote; returns frames to send.

        Raises AuthenticationError (wrong key, substituted fingerprint, reflected or out-of-order
        handshake, any other message before completion) or the codec's RemoteProtocolError for a
        malformed frame; the channel must then be closed. LocalProtocolError once finished.
        """
        if self.state in (State.DONE, State.FAILED):
            raise LocalProtocolError(f"channel authentication is {self.state.value}; route frames elsewhere")
        try:
            if len(data) > MAX_HANDSHAKE_FRAME_BYTES:
                raise AuthenticationError(
                    f"a {len(data)}-byte frame arrived before channel authentication completed "
                    f"(handshake frames are at most {MAX_HANDSHAKE_FRAME_BYTES} bytes)"
                )
            return self._receive(messages.decode(data, max_frame_bytes=MAX_HANDSHAKE_FRAME_BYTES))
        except Exception:
            self.state = State.FAILED
            raise

    def _receive(self, msg: object) -> list[bytes]:
        match msg:
            case AuthHello(peer_id=peer_id, nonce=nonce) if self._remote_nonce is None:
                if peer_id == self.local_peer_id or nonce == self.local_nonce:
                    raise AuthenticationError("the remote hello echoes our own peer id or nonce (a reflected handshake)")
                if self.expected_peer_id is not None and peer_id != self.expected_peer_id:
                    raise AuthenticationError(
                        f"the remote claims peer id {peer_id} but should be {self.expected_peer_id} "
                        "(the one signaling announced)"
                    )
                self.remote_peer_id, self._remote_nonce = peer_id, nonce
                self.state = State.PROOF_SENT
                proof = AuthProof(key_mac=self._mac("key", self.role), channel_mac=self._mac("channel", self.role))
                return [messages.encode(proof)]
            case AuthProof(key_mac=key_mac, channel_mac=channel_mac) if self._remote_nonce is not None:
                remote_role = Role.ANSWERER if self.role is Role.OFFERER else Role.OFFERER
                if not hmac.compare_digest(key_mac, self._mac("key", remote_role)):
                    raise AuthenticationError(
                        f"peer {self.remote_peer_id} failed the swarm key check: it holds another swarm key"
                    )
                if not hmac.compare_digest(channel_mac, self._mac("channel", remote_role)):
                    raise AuthenticationError(
                        f"peer {self.remote_peer_id} failed the DTLS fingerprint check: the two ends saw "
                        "different certificates (a relay substituted a fingerprint)"
                    )
                self.state = State.DONE
                return []
            case _:
                raise AuthenticationError(
                    f"{type(msg).__name__} arrived in state {self.state.value} of channel authentication; "
                    "only AuthHello then AuthProof are allowed before it completes"
                )

    def _mac(self, proof: str, role: Role) -> str:
        assert self.remote_peer_id is not None and self._remote_nonce is not None
        local = (self.local_peer_id, self.local_nonce, self.local_fingerprint)
        remote = (self.remote_peer_id, self._remote_nonce, self.remote_fingerprint)
        offer, answer = (local, remote) if self.role is Role.OFFERER else (remote, local)
        common = transcript(
            offer_peer_id=offer[0],
            answer_peer_id=answer[0],
            offer_nonce=offer[1],
            answer_nonce=answer[1],
            offer_fingerprint=offer[2] if proof == "channel" else None,
            answer_fingerprint=answer[2] if proof == "channel" else None,
        )
        return mac(self._key, proof, role, common)

    def get_timer(self) -> float | None:
        """The handshake deadline (seconds, caller's clock) while it is in progress, else None."""
        return self.deadline if self.state in (State.HELLO_SENT, State.PROOF_SENT) else None

    def handle_timer(self, now: float) -> None:
        """Raise AuthenticationError if the handshake is not done by its deadline."""
        if self.get_timer() is not None and now >= self.deadline:
            self.state = State.FAILED
            raise AuthenticationError(
                "channel authentication did not complete before its deadline (is the other peer in this swarm?)"
            )

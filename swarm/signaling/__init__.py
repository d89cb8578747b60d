"""Signaling: the HTTPS + WebSocket server one Python peer hosts, and the client peers use.

See :mod:`swarm.signaling.server` and :mod:`swarm.signaling.client` for usage, and
docs/protocol.md ("Signaling") for the JSON messages.
"""

from swarm.signaling.auth import derive_signaling_key, swarm_id
from swarm.signaling.client import (
    Disconnected,
    PeerJoined,
    PeerLeft,
    SignalingClient,
    SignalReceived,
    SignalRefused,
    fetch_status,
    signaling_url,
)
from swarm.signaling.messages import PROTOCOL_VERSION, PeerInfo
from swarm.signaling.relay import CloseCode, SignalingRelay
from swarm.signaling.server import SignalingServer

__all__ = [
    "PROTOCOL_VERSION",
    "CloseCode",
    "Disconnected",
    "PeerInfo",
    "PeerJoined",
    "PeerLeft",
    "SignalReceived",
    "SignalRefused",
    "SignalingClient",
    "SignalingRelay",
    "SignalingServer",
    "derive_signaling_key",
    "fetch_status",
    "signaling_url",
    "swarm_id",
]

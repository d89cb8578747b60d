"""The one error tree of colibri-swarm.

Every error the package raises on purpose derives from :class:`SwarmError`.
Errors from aiortc, zeroconf, aiohttp and cryptography are mapped to these at
the edge. A message meant for a user names what was wrong and what to do.
Add new specific errors here, each with a docstring.
"""


class SwarmError(Exception):
    """Base of every error raised on purpose by colibri-swarm."""


class LocalProtocolError(SwarmError):
    """We misused a protocol object (a bug on our side, or a wrong call order)."""


class RemoteProtocolError(SwarmError):
    """The other side sent something the protocol does not allow (malformed, stale, oversized)."""


class ModelFileError(SwarmError):
    """A model file is missing, truncated, inconsistent or of an unsupported kind.

    The message names the file and the tensor or metadata field that was wrong.
    """


class ModelDownloadError(SwarmError):
    """The default model could not be fetched from the package index, or failed its SHA-256 check.

    The message says what failed and what to do (network, pip settings, or ``--model PATH``).
    """


class ChatTemplateError(SwarmError):
    """A chat template refused the messages (its ``raise_exception``) or could not be rendered."""


class AuthenticationError(RemoteProtocolError):
    """The other side could not prove it holds the swarm key (or a transcript was altered)."""


class VersionMismatchError(RemoteProtocolError):
    """The other side speaks another protocol version or holds another model; the message names both."""


class StaleTermError(RemoteProtocolError):
    """A plan or request carried an election term (or plan version) older than ours."""


class FrameError(RemoteProtocolError):
    """A wire frame is malformed: bad magic, version, length, tensor table or trailing bytes.

    The message names the field that was wrong (see docs/protocol.md for the layout).
    """


class ReassemblyError(FrameError):
    """A fragment sequence is inconsistent or exceeds the receive buffer limits."""


class MessageError(RemoteProtocolError):
    """A frame decoded but its fields break the schema of its message kind (docs/protocol.md)."""


class KeyCodeError(SwarmError):
    """A swarm key code (typed or stored) is malformed or its checksum does not match."""


class IdentityError(SwarmError):
    """The stored device identity is unreadable or not an ECDSA P-256 key with its certificate."""


class IdentityInUseError(IdentityError):
    """Another process on this machine runs with the same config directory (a second ``join``).

    The message names that process and what to do (stop it, or give this one its own directory).
    """


class DuplicatePeerError(IdentityError):
    """The signaling server already has a peer with our peer id from another process or machine:
    a copied config directory or a cloned VM. The message names the identity file to delete."""


class AddressError(SwarmError):
    """A signaling address (``--signal``, a printed URL) is malformed; the message shows a valid form."""


class PeerLostError(SwarmError):
    """A peer went away (disconnect, missed deadline) while work was assigned to it."""


class WeightIntegrityError(RemoteProtocolError):
    """Shipped weights failed verification (a chunk or a whole slice did not match its SHA-256)
    more often than a retry can explain; the source is not trusted for this slice."""


class KernelError(SwarmError):
    """A compute kernel cannot give an answer: inputs of the wrong shape, dtype or weight format,
    weights beyond the GPU adapter's limits, or a GPU error / lost device during the request.

    The request fails with this error; no partial or wrong numbers are returned.
    """


class SignalingUnavailableError(SwarmError):
    """No signaling server answered (refused, timed out, TLS pin mismatch, closed before welcome).

    The message names the URL; with mDNS discovery the peer looks again or hosts one itself.
    """


class VerificationError(SwarmError):
    """``--verify``: a peer's answer differed from the coordinator's own recomputation of it.

    The message names the peer and the layer. For an FFN range answer generation stops rather
    than emit tokens that depend on numbers nobody can vouch for; a stage answer is discarded
    instead, its layers run on the coordinator and the peer is never trusted again
    (swarm/peer/coordinator/stage_verify.py).
    """


class ContextLengthError(SwarmError):
    """A prompt plus the tokens asked for do not fit the model's context (or attention window).

    Raised before any work; the message names the prompt's token count, ``max_tokens`` and the limit.
    """


class CoordinatorChangedError(SwarmError):
    """This peer stopped serving the swarm's API mid-request: it stepped down (another peer leads
    a newer term) or it is stopping. The request did not finish here; send it again to the
    current coordinator (``colibri-swarm generate`` and ``chat`` do so by themselves).

    The API answers it as 503 with ``code`` :data:`CODE` (in a stream: an error event), and with
    ``coordinator_url`` (the current coordinator's base URL, ``https://HOST:PORT``) once known."""

    CODE = "coordinator_changed"

    def __init__(self, message: str, coordinator_url: str | None = None) -> None:
        super().__init__(message)
        self.coordinator_url = coordinator_url

    @classmethod
    def stepped_down(cls) -> "CoordinatorChangedError":
        """The error of a request in flight on a coordinator that another peer deposed."""
        return cls("this peer stopped coordinating the swarm (another peer leads a newer term); "
                   "send the request again to the current coordinator")

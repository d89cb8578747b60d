"""The aiortc internals this package relies on, in one place.

aiortc (1.14–1.16) offers no public way to do three things a swarm link needs, so this module
reaches into its private names, and nothing else in the package does:

* **Our own DTLS certificate.** ``RTCPeerConnection`` makes a fresh certificate in ``__init__``
  and keeps it in the name-mangled list ``_RTCPeerConnection__certificates``, read when it
  creates its DTLS transport (first ``createOffer``/``setRemoteDescription``). A peer's id is the
  hash of its long-term certificate key, so :func:`set_certificate` replaces that list right after
  construction.
* **The remote DTLS certificate.** aiortc checks it against the SDP's ``a=fingerprint`` but
  does not expose it; :func:`remote_certificate` reads it from the DTLS transport's OpenSSL
  connection (``RTCDtlsTransport._ssl``) so a Python peer's claimed id can be checked against
  the key it really holds (docs/security.md, "Peer ids").
* **The SCTP minimum retransmission timeout.** aiortc uses the module constant
  ``aiortc.rtcsctptransport.SCTP_RTO_MIN`` (1 s, RFC 4960's default for the Internet). On a LAN
  the round trip is ~1 ms, so one lost packet stalls a small exchange for a full second;
  :func:`configure_aiortc` lowers it to :data:`SCTP_RTO_MIN_S` for the whole process (it is a
  module global: there is no per-connection setting).

Each function raises :class:`~swarm.errors.LocalProtocolError` naming the missing internal when an
aiortc upgrade moves it, and ``tests/peer/test_rtc.py`` checks all three against the installed
aiortc, so an upgrade fails there first and loudly.
"""

from __future__ import annotations

import aiortc
import aiortc.rtcsctptransport as _sctp
from aiortc import RTCPeerConnection
from aiortc.rtcdtlstransport import RTCCertificate
from cryptography import x509

from swarm.errors import LocalProtocolError

SCTP_RTO_MIN_S = 0.1  # seconds; keeps retransmits rare on loopback while removing 1 s stalls

_CERTIFICATES_ATTR = "_RTCPeerConnection__certificates"


def _moved(what: str) -> LocalProtocolError:
    return LocalProtocolError(
        f"aiortc {aiortc.__version__} has no {what}, which colibri-swarm relies on (see swarm/peer/net/rtc.py); "
        "install an aiortc version within the range pyproject.toml names"
    )


def configure_aiortc() -> None:
    """Apply the process-wide aiortc tuning this package relies on (idempotent).

    Raises LocalProtocolError when aiortc no longer has ``rtcsctptransport.SCTP_RTO_MIN``.
    """
    if not hasattr(_sctp, "SCTP_RTO_MIN"):
        raise _moved("aiortc.rtcsctptransport.SCTP_RTO_MIN")
    _sctp.SCTP_RTO_MIN = SCTP_RTO_MIN_S


def set_certificate(pc: RTCPeerConnection, certificate: RTCCertificate) -> None:
    """Make a fresh ``pc`` use ``certificate`` for DTLS.

    Call before ``createOffer``/``setRemoteDescription``. Raises LocalProtocolError when aiortc
    no longer keeps its certificates where this module expects them.
    """
    if not isinstance(getattr(pc, _CERTIFICATES_ATTR, None), list):
        raise _moved(f"RTCPeerConnection.{_CERTIFICATES_ATTR} (the certificate hook)")
    setattr(pc, _CERTIFICATES_ATTR, [certificate])


def remote_certificate(pc: RTCPeerConnection) -> x509.Certificate:
    """The certificate the remote presented in the DTLS handshake of ``pc``'s data channel.

    Valid once the data channel is open (DTLS done). Raises LocalProtocolError when there is no
    completed DTLS session, or when aiortc no longer keeps the OpenSSL connection where expected.
    """
    sctp = pc.sctp
    if sctp is None:
        raise LocalProtocolError("the peer connection has no data channel transport yet")
    if not hasattr(sctp.transport, "_ssl"):
        raise _moved("RTCDtlsTransport._ssl (the DTLS session)")
    ssl = sctp.transport._ssl
    certificate = ssl.get_peer_certificate(as_cryptography=True) if ssl is not None else None
    if certificate is None:
        raise LocalProtocolError("the DTLS handshake has not completed: there is no remote certificate yet")
    return certificate

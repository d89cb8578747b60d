"""colibri-swarm: one inference engine out of the devices on a LAN.

Layers (docs/architecture.md): ``swarm.compute`` (numpy engine and FFN seam),
``swarm.peer`` (identity, channels, wire messages, election, planner,
coordinator, worker), ``swarm.signaling`` (aiohttp signaling server),
``swarm.discovery`` (zeroconf), ``swarm.cli`` (the ``colibri-swarm`` command).
"""

__version__ = "0.1.0"

from swarm.errors import (  # noqa: E402
    LocalProtocolError,
    ModelFileError,
    RemoteProtocolError,
    SwarmError,
)

__all__ = [
    "__version__",
    "SwarmError",
    "LocalProtocolError",
    "RemoteProtocolError",
    "ModelFileError",
]

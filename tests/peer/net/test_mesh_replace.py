"""A peer that started over opens a new link while the old one still looks open: the new link
is the link at once, and every observer sees the old one go down first."""

from __future__ import annotations

import asyncio

from swarm.peer.net.mesh import Mesh
from tests.peer._links import hello

PEER = "b" * 52
CLOSE_S = 3.0  # how long the old link's peer connection takes to close (a dead remote's)


class SlowClosingLink:
    """What the mesh uses of a link; ``close`` takes ``CLOSE_S``, as a dead remote's can."""

    def __init__(self, name: str) -> None:
        self.name, self.peer_id, self.offerer, self.hello = name, PEER, True, None
        self.close_reason: str | None = None
        self._callbacks: list = []

    async def established(self) -> None:
        return None

    def on_close(self, callback) -> None:
        self._callbacks.append(callback)

    async def close(self, reason: str = "closed") -> None:
        self.close_reason = reason
        await asyncio.sleep(CLOSE_S)
        for cb in self._callbacks:
            cb(self)


async def _replace() -> tuple[list, float, dict, SlowClosingLink]:
    async def send_signal(peer, data):
        return None

    mesh = Mesh(local_hello=hello("a" * 52), certificate=None, auth_key=b"k" * 32, send_signal=send_signal)
    seen: list = []
    mesh.on_link_up.append(lambda link: seen.append(("up", link.name)))
    mesh.on_link_down.append(lambda peer: seen.append(("down", peer, mesh.links.get(peer))))
    old, new = SlowClosingLink("old"), SlowClosingLink("new")
    await mesh._establish(old)
    t = asyncio.get_running_loop().time()
    await mesh._establish(new)
    took = asyncio.get_running_loop().time() - t
    await asyncio.sleep(0)
    links = dict(mesh.links)
    await mesh.close()  # cancels the old link's slow close
    return seen, took, links, old


def test_a_replaced_link_is_down_for_observers_and_the_new_one_is_up_at_once():
    seen, took, links, old = asyncio.run(_replace())
    assert took < 0.5, f"the new link waited {took:.1f} s for the old one to close"
    assert seen == [("up", "old"), ("down", PEER, None), ("up", "new")]
    assert links[PEER].name == "new"
    assert old.close_reason == "replaced by a new link (the peer started over)"

"""The coordinator's API port: remembered per config directory, so that a coordinator elected
again on the same machine serves at the same URL; a taken port gives way to a free one."""

from __future__ import annotations

import asyncio
import logging
import socket

from swarm.compute.model import load_model
from swarm.keys.identity import Identity
from swarm.keys.swarmkey import SwarmKey
from swarm.peer.coordinator.api_host import API_PORT_FILE
from swarm.peer.coordinator.role import CoordinatorRole
from swarm.peer.node import Node
from tests.peer._swarm_models import build


class Election:  # what the API start reads of the election
    term = 1


async def _serve_twice(tmp_path, model, taken: socket.socket | None = None,
                       api_port: int | None = None) -> tuple[int, int]:
    ident = Identity.generate()
    node = Node(swarm_key=SwarmKey(bytes(32)), certificate=ident.rtc_certificate(), peer_id=ident.peer_id,
                status_path=tmp_path / "status.json", model_hash=model.content_hash(), memory_budget=1 << 30,
                ffn_gflops=1.0)
    role = CoordinatorRole(node, model, Election(), api_host="127.0.0.1", api_port=api_port)
    ports = []
    for term in (1, 2):  # elected, deposed, elected again
        await role._open_api(term)
        ports.append(role.api_port)
        await role._close_api()
        if taken is not None and term == 1:
            taken.bind(("127.0.0.1", ports[0]))  # someone else takes it meanwhile
            taken.listen()
    return ports[0], ports[1]


def test_the_api_port_is_remembered_in_the_config_directory_and_a_taken_one_gives_way(tmp_path, caplog):
    model = load_model(build("olmoe", tmp_path / "model"))
    first, again = asyncio.run(_serve_twice(tmp_path, model))
    assert first == again != 0
    assert (tmp_path / API_PORT_FILE).read_text().strip() == str(first)

    with socket.socket() as taken, caplog.at_level(logging.WARNING, logger="swarm.peer.coordinator.api_host"):
        remembered, fresh = asyncio.run(_serve_twice(tmp_path, model, taken))
    assert remembered == first and fresh not in (0, first)
    assert f"the API's port {first} is taken" in caplog.text
    assert (tmp_path / API_PORT_FILE).read_text().strip() == str(first)  # tried again next time


def test_a_port_given_with_api_port_is_the_directory_s_from_then_on(tmp_path):
    """`join --api-port N` once, then `join` without it: the API serves on N again (README: the
    default is the port this config directory served on before)."""
    model = load_model(build("olmoe", tmp_path / "model"))
    first, _ = asyncio.run(_serve_twice(tmp_path, model))  # a free port, remembered
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        chosen = s.getsockname()[1]
    assert chosen != first
    given, again = asyncio.run(_serve_twice(tmp_path, model, api_port=chosen))
    assert given == again == chosen
    assert (tmp_path / API_PORT_FILE).read_text().strip() == str(chosen)
    later, _ = asyncio.run(_serve_twice(tmp_path, model))  # no --api-port: the one served before
    assert later == chosen

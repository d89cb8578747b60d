"""Every Dispatcher the code and its benches hand a dispatch has every method of the protocol.

The dispatchers are duck-typed (``typing.Protocol``): a method added to the protocol and missed in
one of them fails only when that dispatcher runs — for a bench, on the machine it was meant to
measure. Oracle: the protocol's own methods.
"""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

import pytest

from swarm.peer.coordinator.dispatch import Dispatcher
from swarm.peer.coordinator.handoff import LoopDispatcher

ROOT = Path(__file__).resolve().parents[3]


def _bench(name: str):
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _protocol_methods() -> set[str]:
    return {n for n, v in vars(Dispatcher).items() if inspect.isfunction(v) and not n.startswith("_")}


def test_the_protocol_names_the_methods_a_dispatch_calls():
    assert {"send", "last_heard", "peer_failed", "peer_not_ready", "lead_state"} <= _protocol_methods()


@pytest.mark.parametrize("where", ["handoff", "serve", "coordinator_alone", "fakes"])
def test_every_dispatcher_has_every_method(where):
    if where == "handoff":
        classes = [LoopDispatcher]
    elif where == "fakes":
        from tests.fakes import LoopbackDispatcher
        classes = [LoopbackDispatcher]
    else:
        module = _bench(where)
        classes = [c for c in vars(module).values()
                   if inspect.isclass(c) and c.__module__ == module.__name__ and hasattr(c, "peer_not_ready")]
        assert classes, f"bench/{where}.py has no dispatcher"
    for cls in classes:
        missing = _protocol_methods() - {n for n in dir(cls) if callable(getattr(cls, n, None))}
        assert not missing, f"{cls.__qualname__} lacks {sorted(missing)}"

"""Prefix reuse: the KV caches of finished sequences, kept so that a later prompt starting with
the same tokens continues from them instead of prefilling those tokens again (docs/serving.md,
"Prefix reuse").

Theory of operation
-------------------
When a sequence leaves the batch (finished, stopped or its client gone — never failed), the batch
scheduler hands :meth:`PrefixStore.keep` its KV cache and the tokens whose keys/values the cache
holds: the prompt and every generated token fed back (the last sampled one never was). When a
sequence joins, :meth:`PrefixStore.take` looks for the entry sharing the longest prefix with its
prompt, truncates that cache to the shared prefix (at most the prompt less one token: the last
prompt token's logits are needed) and hands it over; the entry leaves the store, one cache
serving one sequence. Every row's keys/values depend only on the row, its position and the cache
before it (docs/serving.md, "Why a sequence's tokens do not change"), so the positions reused are
the bits a fresh prefill would write, and the reply is the same.

An entry is taken only when the shared prefix is at least half of it: a short common opening
(a system prompt) does not take a long conversation's cache from that conversation's next turn.

The ``owner`` of an entry is the layer backend that holds part of its keys/values (the stage
dispatch: the rest lives on stage peers, keyed by the sequence that filled it), or None when the
cache holds every layer's keys/values here. An entry is reused under the same owner only, and
dropped at the first :meth:`PrefixStore.take` under another (its backend was replaced).

Memory. The store holds positions nobody else needs: ``keep`` and ``make_room`` are given the
positions left beside the running sequences' claims (prompt + ``max_tokens`` each, within the
server's ``--context``) and evict least recently used entries until the store fits; a new
sequence's admission never waits for the store. Without a bound at most ``max_entries`` are kept.

Not thread-safe: its scheduler calls it under its own lock.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from swarm.compute.model import KVCache

MAX_ENTRIES = 16  # caches kept when no position bound is given
# Kept caches holding recurrent states (Qwen3.5's linear attention): each holds a state per
# linear layer whatever its length, which positions do not bound; the memory plan reserves
# states for this many beside the running sequences (swarm.peer.plan.reserve_of).
MAX_STATE_ENTRIES = 8


@dataclass(eq=False)
class Retained:
    """A finished sequence's KV cache and the tokens it holds (``tokens[i]`` at position i)."""

    tokens: tuple[int, ...]
    cache: KVCache
    owner: object | None


class PrefixStore:
    """Finished sequences' KV caches, least recently used first (module docstring).

    Counters (tests, metrics): ``reused_tokens`` handed out with a cache, ``kept`` entries stored,
    ``evicted`` entries dropped to make room."""

    def __init__(self, max_entries: int = MAX_ENTRIES) -> None:
        self.max_entries = max_entries
        self._entries: OrderedDict[int, Retained] = OrderedDict()
        self._keys = 0
        self.reused_tokens = self.kept = self.evicted = 0

    def positions(self) -> int:
        """KV positions the kept caches hold, all together."""
        return sum(e.cache.length for e in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def keep(self, tokens: Sequence[int], cache: KVCache, owner: object | None, room: int | None) -> None:
        """Store ``cache``, which holds the keys/values of ``tokens[:cache.length]``, then evict
        least recently used entries until the store holds at most ``room`` positions (None: no
        bound but ``max_entries``); a cache larger than ``room`` alone is not kept (nor evicts any).
        A cache of another class than :class:`~swarm.compute.model.KVCache` (whose truncation
        this store cannot vouch for) is not kept."""
        from swarm.compute.model import KVCache

        if (type(cache) is not KVCache or cache.length < 1 or len(tokens) < cache.length
                or (room is not None and cache.length > room)):
            return
        self._keys += 1
        self._entries[self._keys] = Retained(tuple(tokens[:cache.length]), cache, owner)
        self.kept += 1
        self.make_room(room)

    def make_room(self, room: int | None) -> None:
        """Evict least recently used entries until at most ``room`` positions (None: at most
        ``max_entries`` entries) are held, and at most :data:`MAX_STATE_ENTRIES` of them hold
        recurrent states."""
        while self._entries and (len(self._entries) > self.max_entries or
                                 (room is not None and self.positions() > room)):
            self._entries.popitem(last=False)
            self.evicted += 1
        stateful = [k for k, e in self._entries.items() if any(st is not None for st in e.cache.states)]
        for k in stateful[:max(len(stateful) - MAX_STATE_ENTRIES, 0)]:  # the least recently used go
            del self._entries[k]
            self.evicted += 1

    def take(self, prompt: Sequence[int], owner: object | None) -> tuple[KVCache | None, int]:
        """The cache of the entry under ``owner`` sharing the longest prefix with ``prompt`` (at
        least half of the entry), truncated to ``n`` positions, and ``n``: the prompt tokens it
        holds, at most ``len(prompt) - 1``. (None, 0) when no entry fits. A cache with a recurrent
        state (Qwen3.5's linear attention) fits only where its state can run on from: the whole
        cache, as a conversation's next turn continues it (:meth:`KVCache.resumes`). Entries of
        another owner are dropped."""
        for key in [k for k, e in self._entries.items() if e.owner is not owner]:
            del self._entries[key]
            self.evicted += 1
        best, best_n = None, 0
        for key, entry in self._entries.items():
            n = _common_prefix(entry.tokens, prompt, len(prompt) - 1)
            if n > best_n and 2 * n >= len(entry.tokens) and entry.cache.resumes(n):
                best, best_n = key, n
        if best is None:
            return None, 0
        entry = self._entries.pop(best)
        entry.cache.truncate(best_n)
        self.reused_tokens += best_n
        return entry.cache, best_n

    def clear(self) -> None:
        """Drop every entry (e.g. the backend that filled them is gone)."""
        self.evicted += len(self._entries)
        self._entries.clear()


def _common_prefix(a: Sequence[int], b: Sequence[int], limit: int) -> int:
    """How many leading tokens ``a`` and ``b`` share, at most ``limit``."""
    n = min(len(a), len(b), limit)
    for i in range(n):
        if a[i] != b[i]:
            return i
    return max(n, 0)

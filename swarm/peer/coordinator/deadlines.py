"""How long the coordinator waits for a worker, from what it measured: one rule for the FFN
ranges (:class:`~swarm.peer.coordinator.dispatch.RemoteFFN`) and the layer stages
(:class:`~swarm.peer.coordinator.stages.StagedFFN`).

Sans-I/O: nothing here sends or reads a clock; every call takes ``now`` (monotonic seconds)
and the dispatchers hold their own locks around it. :func:`wait_answer` is the one wait, on
the future a dispatcher completes when the answer comes, with the clock it is given.

The rule
--------
* **Deadline.** A request's deadline follows the peer's answers (:class:`PeerTiming`):
  ``DEADLINE_SAFETY`` × (RTT + a high quantile of its answer times beyond its per-row compute +
  that compute for the request's rows), at least ``DEADLINE_MIN_S``, doubled per miss in a row,
  at most the ceiling ``DEADLINE_MAX_S`` + ``DEADLINE_SAFETY`` × the rows' expected compute.
* **First request.** A peer's first request under a share or stage it has not answered yet pays
  for loading it — slices fetched and decoded, or a stage's pages read from disk on a peer whose
  memory cap keeps them out of the page cache (a 6 GB stage: seconds). Its deadline is
  :func:`first_deadline_s` of the bytes to load, ``FIRST_DEADLINE_S`` +
  bytes / ``COLD_READ_BYTES_S``, and its answer time is not taken as the peer's speed.
* **Late, not gone.** A request past its deadline is recomputed by the coordinator and kept
  ``LATE_KEPT_S``: if its answer still comes, within the ceiling, the peer is slow, not gone — its
  misses reset, and its time is observed, so the next deadlines cover it.
* **Miss.** A missed deadline fails the peer only at its first request (it could not even load),
  at ``MISS_LIMIT`` misses in a row, or when its link has been silent ``SILENCE_S`` (links beat
  every second); otherwise the next step is sent to it again. A wait also ends early when the
  link has been silent ``SILENCE_S`` (:meth:`Deadlines.gone_silent`), so a generous first
  deadline does not stall a run behind a stopped peer.
* **Suspect.** A peer with a missed request still unanswered (kept for :meth:`Deadlines.late`)
  and nothing heard from it since that request was sent (links beat every second) is suspect
  (:meth:`Deadlines.suspect`): it gets no request and no wait — its rows, or its stage's
  layers, are computed by the coordinator at once (the same bits), and no miss is counted for
  what was never sent. So a stopped or killed peer costs a run one deadline, not the sum of
  its doubled deadlines. It is sent requests again as soon as anything is heard from it (a
  heartbeat, its late answer), or is failed when its link has been silent ``SILENCE_S``
  (:meth:`Deadlines.silence`), as at a miss (:meth:`Deadlines.hold` says both). A peer whose
  last contact is unknown (``heard`` None) is never suspect.
"""

from __future__ import annotations

import concurrent.futures as cf
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

# Deadline of one request (seconds), see PeerTiming.deadline_s.
DEADLINE_MIN_S = 0.25
DEADLINE_MAX_S = 2.0
DEADLINE_SAFETY = 3.0
OVERHEAD_QUANTILE = 0.9
OVERHEAD_SAMPLES = 32
FIRST_DEADLINE_S = 30.0  # a first request: fetching and decoding slices, opening weights
COLD_READ_BYTES_S = 50e6  # a first request's weights read from disk: a slow disk or a throttled volume
MISS_LIMIT = 3  # deadlines missed in a row that mark a peer failed
SILENCE_S = 2.5  # a peer that missed a deadline and sent nothing this long is failed at once (links beat every 1 s)
NOT_READY_RETRY_S = 0.5  # a peer that has not accepted the plan gets one probe request this often
LATE_KEPT_S = 60.0  # late answers are still timed this long after their request
EWMA = 0.2  # weight of the newest sample in the per-row compute estimate


def first_deadline_s(load_bytes: int = 0) -> float:
    """Seconds to wait for a peer's first answer under a share or stage of ``load_bytes``
    weight bytes it may have to read first: ``FIRST_DEADLINE_S`` + bytes / ``COLD_READ_BYTES_S``."""
    return FIRST_DEADLINE_S + max(load_bytes, 0) / COLD_READ_BYTES_S


@dataclass
class PeerTiming:
    """What the coordinator measured about one worker (seconds).

    ``s_per_row``: moving average of (answer time − RTT) / rows, the peer's speed (planner,
    status). ``overheads``: recent answer times beyond RTT and that per-row estimate — the
    message cost and the scheduling noise of a busy machine, which do not scale with rows;
    their high quantile sets the deadline. ``load_bytes``: what its next first request may read
    from disk. Not thread-safe: the dispatchers hold their locks.
    """

    rtt_s: float = 0.002
    s_per_row: float | None = None  # None until a first answer came back
    requests: int = 0  # answers timed (late ones included)
    failures: int = 0
    misses: int = 0  # deadlines missed since its last answer within the ceiling
    late: int = 0  # answers that came after their deadline (their rows were recomputed)
    fresh: bool = True  # no answer yet under its current share (its slices may still be coming)
    load_bytes: int = 0  # weight bytes of the share or stage it has not answered yet
    overheads: deque = field(default_factory=lambda: deque(maxlen=OVERHEAD_SAMPLES))

    def overhead_s(self) -> float:
        """The OVERHEAD_QUANTILE of the recent overheads (0 before any)."""
        if not self.overheads:
            return 0.0
        ranked = sorted(self.overheads)
        return ranked[min(int(OVERHEAD_QUANTILE * len(ranked)), len(ranked) - 1)]

    @property
    def first(self) -> bool:
        """Whether its next request is a first one (no answer yet, or none under its share)."""
        return self.fresh or self.s_per_row is None

    def deadline_s(self, rows: int) -> float:
        """Seconds to wait for the answer to a request of ``rows`` rows (module docstring)."""
        if self.first:
            return first_deadline_s(self.load_bytes)
        expected = DEADLINE_SAFETY * (self.rtt_s + self.overhead_s() + self.s_per_row * rows)
        return min(max(expected, DEADLINE_MIN_S) * 2.0 ** self.misses, self.ceiling_s(rows))

    def ceiling_s(self, rows: int) -> float:
        """The longest deadline for ``rows`` rows: DEADLINE_MAX_S + DEADLINE_SAFETY × their
        expected compute (a long prefill may take long), never below DEADLINE_MIN_S."""
        return max(DEADLINE_MAX_S + DEADLINE_SAFETY * (self.s_per_row or 0.0) * rows, DEADLINE_MIN_S)

    def observe(self, elapsed_s: float, rows: int) -> None:
        """An answer to ``rows`` rows came ``elapsed_s`` after its request (in time or not)."""
        sample = max(elapsed_s - self.rtt_s, 0.0) / max(rows, 1)
        if self.s_per_row is None:
            if not (self.fresh and self.load_bytes):  # a pass that read its weights first is not its speed
                self.s_per_row = sample
        elif not self.fresh:  # a first answer under a new share includes loading it: not a compute sample
            self.overheads.append(max(elapsed_s - self.rtt_s - self.s_per_row * rows, 0.0))
            self.s_per_row = (1 - EWMA) * self.s_per_row + EWMA * sample
        self.fresh = False
        self.load_bytes = 0
        self.requests += 1


@dataclass
class Sent:
    """A request in flight: to ``peer``, ``rows`` rows, sent at ``sent_at``, due at ``deadline``;
    ``first``: the peer's first request under its share or stage (a miss fails it at once)."""

    peer: str
    rows: int
    sent_at: float
    deadline: float
    first: bool


class Deadlines:
    """Per-peer :class:`PeerTiming` (``timing``), and the requests past their deadline whose
    answer still counts (module docstring)."""

    def __init__(self) -> None:
        self.timing: dict[str, PeerTiming] = {}
        self._late: dict[int, Sent] = {}
        self.withheld = 0  # requests not sent to a suspect peer (its rows computed by the coordinator)

    def of(self, peer: str) -> PeerTiming:
        return self.timing.setdefault(peer, PeerTiming())

    def loading(self, peer: str, load_bytes: int) -> None:
        """``peer``'s next request is a first one of ``load_bytes`` weight bytes (a share or
        stage it has not answered yet): it gets :func:`first_deadline_s` of them."""
        t = self.of(peer)
        t.fresh, t.load_bytes = True, max(int(load_bytes), 0)

    def sent(self, peer: str, rows: int, now: float) -> Sent:
        """A request of ``rows`` rows leaves for ``peer`` at ``now``: when it is due."""
        t = self.of(peer)
        return Sent(peer, rows, now, now + t.deadline_s(rows), t.first)

    def answered(self, s: Sent, now: float) -> None:
        """``s`` was answered in time."""
        t = self.of(s.peer)
        t.observe(now - s.sent_at, s.rows)
        t.misses = 0

    def suspect(self, peer: str, heard: float | None) -> bool:
        """Whether ``peer`` is to be sent nothing now (module docstring, "Suspect"): a request it
        missed is still unanswered and it has not been heard since that request was sent
        (``heard``: when it was last heard; None: unknown, never suspect)."""
        return heard is not None and any(s.peer == peer and heard <= s.sent_at for s in self._late.values())

    def hold(self, peer: str, now: float, heard: float | None) -> tuple[bool, str | None]:
        """Whether to send ``peer`` nothing at ``now`` (it is :meth:`suspect`; counted in
        ``withheld``), and why it fails, when its link has also been silent ``SILENCE_S``
        (:meth:`silence`), or None."""
        if not self.suspect(peer, heard):
            return False, None
        self.withheld += 1
        why = self.silence(now, heard)
        return True, None if why is None else f"suspect since a missed request; {why}"

    @staticmethod
    def silence(now: float, heard: float | None) -> str | None:
        """Why a peer last heard at ``heard`` fails for silence at ``now`` (its link silent more
        than ``SILENCE_S``), or None."""
        if heard is not None and now - heard > SILENCE_S:
            return f"nothing heard for {now - heard:.1f} s"
        return None

    @staticmethod
    def gone_silent(s: Sent, now: float, heard: float | None) -> bool:
        """Whether to stop waiting for ``s`` before its deadline: its link has been silent
        ``SILENCE_S`` since after it was sent (``heard``: when the peer was last heard)."""
        return heard is not None and now - s.sent_at > SILENCE_S and now - heard > SILENCE_S

    def missed(self, rid: int, s: Sent, now: float, heard: float | None) -> str | None:
        """Request ``rid`` got no answer by its deadline (or its link went silent): count the miss
        and keep ``s`` for :meth:`late`. Returns why the peer fails, or None: it keeps its work."""
        self._late = {r: q for r, q in self._late.items() if now - q.sent_at < LATE_KEPT_S}
        self._late[rid] = s
        t = self.of(s.peer)
        t.misses += 1
        silent = self.silence(now, heard)
        if s.first:
            return "its first request under a new share or stage"
        if silent:
            return silent
        if t.misses >= MISS_LIMIT:
            return f"{t.misses} misses in a row"
        return None

    def late(self, rid: int, peer: str, now: float) -> bool:
        """An answer to ``rid`` came from ``peer`` after its deadline: time it (within the ceiling
        the peer is slow, not gone: its misses reset). False for an id not awaited late."""
        s = self._late.get(rid)
        if s is None or s.peer != peer:
            return False
        del self._late[rid]
        t = self.of(peer)
        elapsed = now - s.sent_at
        if elapsed <= t.ceiling_s(s.rows) or s.first:
            t.misses = 0  # slow, not gone: its deadline now covers this
        t.observe(elapsed, s.rows)
        t.late += 1
        return True

    def forget(self, peer: str) -> None:
        """``peer``'s link closed: its late requests will never be answered."""
        self._late = {r: q for r, q in self._late.items() if q.peer != peer}


WAIT_SLICE_S = 0.5  # a wait looks at the link's silence this often


def wait_answer(future: cf.Future, s: Sent, clock: Callable[[], float],
                last_heard: Callable[[str], float | None]):
    """``future``'s result (the answer to ``s``), waiting until its deadline or until the
    peer's link has been silent ``SILENCE_S`` (:meth:`Deadlines.gone_silent`), whichever comes
    first; cf.TimeoutError then. Raises what the future raises (ConnectionError: link gone)."""
    left = s.deadline - clock()
    while True:
        if left <= 0 or Deadlines.gone_silent(s, clock(), last_heard(s.peer)):
            return future.result(timeout=0)
        step = min(left, WAIT_SLICE_S)
        try:
            return future.result(timeout=step)
        except cf.TimeoutError:
            left -= step

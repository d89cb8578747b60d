"""The request tracker: what the coordinator has asked of its workers, and the one rule for
what a late, missing, refused or failed answer means. Both dispatchers use it — the FFN ranges
(:class:`~swarm.peer.coordinator.dispatch.RemoteFFN`) and the layer stages
(:class:`~swarm.peer.coordinator.stages.StagedFFN`) — so the rule lives here only.

Sans-I/O, in the manner of aioquic's ``recovery.py``: nothing here sends or reads a clock;
every call takes ``now`` (monotonic seconds). :class:`RequestTracker` holds the requests in
flight (each with the :class:`concurrent.futures.Future` its answer completes), those past their
deadline whose answer still counts, each peer's timing (:class:`PeerTiming`), the peers held as
not ready and those failed, under one lock: the token-loop thread sends and waits, the event
loop delivers. :func:`wait_answer` is the one wait, with the clock it is given; its timeout
and the miss it records happen under that lock in one step (:meth:`RequestTracker.expire`), so
an answer that arrives meanwhile is used, not dropped and counted as a miss.
:meth:`RequestTracker.observations` is what the cost model reads of it (:class:`Observations`).

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
  link has been silent ``SILENCE_S`` (:meth:`RequestTracker.gone_silent`), so a generous first
  deadline does not stall a run behind a stopped peer.
* **Suspect.** A peer with a missed request still unanswered (kept for :meth:`RequestTracker.late`)
  and nothing heard from it since that request was sent (links beat every second) is suspect
  (:meth:`RequestTracker.suspect`): it gets no request and no wait — its rows, or its stage's
  layers, are computed by the coordinator at once (the same bits), and no miss is counted for
  what was never sent. So a stopped or killed peer costs a run one deadline, not the sum of
  its doubled deadlines. It is sent requests again as soon as anything is heard from it (a
  heartbeat, its late answer), or is failed when its link has been silent ``SILENCE_S``
  (:meth:`RequestTracker.silence`), as at a miss (:meth:`RequestTracker.may_send` says both). A peer whose
  last contact is unknown (``heard`` None) is never suspect.
* **Not ready.** A ``stale_term`` refusal (the peer does not serve that plan or layout: it lost or
  refused it) is no failure: the peer's rows are computed by the coordinator, it is held
  (:meth:`RequestTracker.hold_not_ready`) but for one probe every ``NOT_READY_RETRY_S``, and sent
  the plan again, until an answer shows it serves it or a newer plan replaces it.
* **Failed.** A closed link, a malformed answer, a refusal or a miss that fails it
  (:meth:`RequestTracker.fail`): the peer gets no more work until a new plan has it again
  (:meth:`RequestTracker.readmit`).
* **Left.** A peer that closed its link (one that leaves does, at Ctrl-C or SIGTERM) gets no more
  work either (:meth:`RequestTracker.peer_down` with ``left``), but it did not fail: what fails
  with its link is neither counted, nor logged as a fault, nor told to the owner.
* **Distrusted.** A stage answer that ``--verify`` found wrong (:meth:`RequestTracker.distrust`):
  the peer fails as above and no new plan readmits it — a peer that lied once is not asked again.
  The cost of checking is counted (:meth:`RequestTracker.verified`, :class:`VerifyCost`).
* **Lead.** A step starts only while this peer coordinates the step's term with a majority of
  the swarm heard from recently (the election's check-quorum, :func:`confirm_lead`). A
  coordinator that wakes from a stall (a laptop's sleep) may have been deposed meanwhile: its
  deadlines have all passed, so without this it would compute its workers' rows itself and
  finish its requests under a term the swarm has left, racing its own step-down. It waits
  instead until its event loop hears the swarm (it still leads) or steps down (the step fails
  with :meth:`~swarm.errors.CoordinatorChangedError.stepped_down`, which the API hands back).
"""

from __future__ import annotations

import concurrent.futures as cf
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from swarm.errors import CoordinatorChangedError
from swarm.peer.coordinator.api_metrics import Histogram
from swarm.peer.net.messages import Error

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
# GET /metrics' buckets of a peer's answer times (s): a decode step's answer on a LAN takes ms, a
# long prefill's or a first request's seconds.
ANSWER_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 30.0)


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
    from disk. Not thread-safe: :class:`RequestTracker` holds its lock around it.
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
    answers: Histogram = field(default_factory=lambda: Histogram(ANSWER_BUCKETS_S))  # every answer's time

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
        if self.first or self.s_per_row is None:
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
        self.answers.observe(elapsed_s)


@dataclass
class Sent:
    """A request in flight: to ``peer``, ``rows`` rows, sent at ``sent_at``, due at ``deadline``;
    ``first``: the peer's first request under its share or stage (a miss fails it at once)."""

    peer: str
    rows: int
    sent_at: float
    deadline: float
    first: bool


@dataclass
class Pending:
    """A request in flight: the message, the future its answer (or a ConnectionError) completes,
    and when it was sent and is due (:class:`Sent`)."""

    request: Any
    future: cf.Future
    sent: Sent

    @property
    def peer(self) -> str:
        return self.sent.peer

    @property
    def sent_at(self) -> float:
        return self.sent.sent_at

    @property
    def deadline(self) -> float:
        return self.sent.deadline

    @property
    def rows(self) -> int:
        return self.sent.rows


@dataclass(frozen=True)
class Missed:
    """A request got no answer by its deadline (or its link went silent): its rows are computed by
    the coordinator. ``why``: why the peer fails, or None (it keeps its work); ``misses``: its
    misses in a row."""

    why: str | None
    misses: int


@dataclass
class LayerTiming:
    """Seconds per row per layer of a stage's layers (EWMA; None before any)."""

    s_per_row_layer: float | None = None

    def observe(self, elapsed_s: float, rows: int, layers: int) -> None:
        sample = elapsed_s / max(rows * layers, 1)
        prev = self.s_per_row_layer
        self.s_per_row_layer = sample if prev is None else 0.8 * prev + 0.2 * sample


@dataclass(frozen=True)
class PeerObservation:
    """What the answers of one peer showed (seconds): ``s_per_row`` (answer time beyond RTT per
    row, None before any), ``s_per_row_layer`` (a stage's compute per row and layer, as it
    reports it; None without stage answers), ``overhead_s`` (a short stage step's wait beyond
    RTT and compute; None before one), and counts."""

    rtt_s: float
    s_per_row: float | None
    requests: int
    failures: int
    misses: int
    late: int
    s_per_row_layer: float | None = None
    overhead_s: float | None = None


@dataclass(frozen=True)
class VerifyCost:
    """What ``--verify`` cost on stage answers: ``answers`` checked (a row of them sampled),
    ``rows_checked`` against the peer's, ``rows_computed`` here to check them (the shadow caches'
    catch-up included; :mod:`~swarm.peer.coordinator.stage_verify`), ``seconds`` of that compute,
    and ``rows_answered``: every row the stage peers answered, the base of the share."""

    answers: int = 0
    rows_checked: int = 0
    rows_computed: int = 0
    seconds: float = 0.0
    rows_answered: int = 0


@dataclass(frozen=True)
class Observations:
    """A snapshot of a :class:`RequestTracker`: per peer what its answers showed, the peers
    failed, ``local_s_per_row_layer``: the coordinator's own layers' speed (stages only), what
    checking answers cost (``verify``) and the peers no longer trusted, each with why
    (``distrusted``: the VerificationError's text)."""

    peers: Mapping[str, PeerObservation]
    failed: frozenset[str] = frozenset()
    local_s_per_row_layer: float | None = None
    verify: VerifyCost = VerifyCost()
    distrusted: Mapping[str, str] = field(default_factory=dict)

    def of(self, peer: str) -> PeerObservation | None:
        return self.peers.get(peer)


class RequestTracker:
    """The requests in flight, per-peer :class:`PeerTiming` (``timing``), the requests past their
    deadline whose answer still counts, the peers not ready (``not_ready``: peer → (term,
    version, next probe time)) and failed (``failed``); see the module docstring. Thread-safe."""

    def __init__(self) -> None:
        self.timing: dict[str, PeerTiming] = {}
        self.not_ready: dict[str, tuple[int, int, float]] = {}
        self.failed: set[str] = set()  # peers given no more work until a new plan has them
        self.left: set[str] = set()  # of those, the peers that closed their link (leaving): not failures
        self.layer_timing: dict[str, LayerTiming] = {}  # each stage peer's compute, from its answers
        self.message_overhead: dict[str, float] = {}  # peer → a short step's wait beyond RTT and compute (EWMA, s)
        self.local_timing = LayerTiming()  # the coordinator's own layers under stages
        self.withheld = 0  # requests not sent to a suspect peer (its rows computed by the coordinator)
        self.distrusted: dict[str, str] = {}  # peer → why its answers are no longer trusted (never readmitted)
        self.verify_cost = VerifyCost()
        self._pending: dict[int, Pending] = {}
        self._late: dict[int, Sent] = {}
        self._lock = threading.RLock()

    # ------------------------------------------------------------------ timing
    def answer_times(self) -> dict[str, tuple[Histogram, int]]:
        """Per peer: a copy of its answer-time histogram (s, every answer timed, late ones too)
        and how often it was marked down (GET /metrics)."""
        with self._lock:
            return {p: (t.answers.copy(), t.failures) for p, t in self.timing.items()}

    def of(self, peer: str) -> PeerTiming:
        with self._lock:
            return self.timing.setdefault(peer, PeerTiming())

    def set_rtt(self, peer: str, rtt_s: float) -> None:
        """Measured link round trip of ``peer`` (from the link's heartbeats)."""
        self.of(peer).rtt_s = float(rtt_s)

    def measure_afresh(self, peer: str) -> None:
        """``peer`` linked anew (a restart, maybe on other hardware or with other settings, or a
        new link): what its old answers showed of its speed — per row, per stage layer, its
        message overhead — no longer counts; its hello's figure does until it answers again (its
        next request is a first one). Its counts (requests, failures, answer times) stay."""
        with self._lock:
            t = self.timing.get(peer)
            if t is not None:
                t.s_per_row = None
                t.overheads.clear()
                t.misses = 0
            self.layer_timing.pop(peer, None)
            self.message_overhead.pop(peer, None)

    def loading(self, peer: str, load_bytes: int) -> None:
        """``peer``'s next request is a first one of ``load_bytes`` weight bytes (a share or
        stage it has not answered yet): it gets :func:`first_deadline_s` of them."""
        with self._lock:
            t = self.of(peer)
            t.fresh, t.load_bytes = True, max(int(load_bytes), 0)

    def sent(self, peer: str, rows: int, now: float) -> Sent:
        """A request of ``rows`` rows leaves for ``peer`` at ``now``: when it is due."""
        with self._lock:
            t = self.of(peer)
            return Sent(peer, rows, now, now + t.deadline_s(rows), t.first)

    def answered(self, s: Sent, now: float) -> None:
        """``s`` was answered in time (and the peer serves its plan: no longer held as not ready)."""
        with self._lock:
            t = self.of(s.peer)
            t.observe(now - s.sent_at, s.rows)
            t.misses = 0
            self.not_ready.pop(s.peer, None)

    def observe_stage(self, peer: str, compute_s: float, wait_s: float, rows: int, layers: int,
                      short: bool) -> None:
        """A stage answer of ``rows`` rows through ``layers`` layers came ``wait_s`` after its request;
        the peer reports ``compute_s`` of computing. A ``short`` step's wait beyond the round trip and
        the compute is the message's cost (a prefill's rows take their own time on the link)."""
        with self._lock:
            compute = min(max(compute_s, 0.0), wait_s)
            self.layer_timing.setdefault(peer, LayerTiming()).observe(compute, rows, layers)
            if short:
                sample = max(wait_s - compute - self.of(peer).rtt_s, 0.0)
                prev = self.message_overhead.get(peer)
                self.message_overhead[peer] = sample if prev is None else 0.8 * prev + 0.2 * sample

    def observe_local(self, elapsed_s: float, rows: int, layers: int) -> None:
        """The coordinator ran ``rows`` rows through ``layers`` of its own layers in ``elapsed_s``."""
        with self._lock:
            self.local_timing.observe(elapsed_s, rows, layers)

    # ------------------------------------------------------------------ requests
    def track(self, rid: int, request: Any, peer: str, rows: int, now: float) -> Pending:
        """Request ``rid`` of ``rows`` rows leaves for ``peer`` at ``now``: await its answer."""
        with self._lock:
            p = self._pending[rid] = Pending(request, cf.Future(), self.sent(peer, rows, now))
            return p

    def withdraw(self, p: Pending) -> None:
        """``p`` could not be sent (its link is gone): nothing to await."""
        with self._lock:
            self._pending.pop(_rid(p), None)

    def pending_of(self, rid: int) -> Pending | None:
        with self._lock:
            return self._pending.get(rid)

    def deliver(self, peer: str, msg: Any, now: float) -> bool:
        """An answer (or :class:`Error`) to request ``msg.request_id`` came from ``peer`` at ``now``:
        it completes the request's future. One past its deadline is timed (:meth:`late`; returns
        True); a forged id, or one given up on, is dropped."""
        with self._lock:
            p = self._pending.get(msg.request_id)
            if p is None or p.peer != peer:
                return not isinstance(msg, Error) and self.late(msg.request_id, peer, now)
            del self._pending[msg.request_id]
        if not p.future.done():
            p.future.set_result(msg)
        return False

    def peer_down(self, peer: str, reason: str, left: bool = False) -> None:
        """``peer``'s link went away: its pending requests fail now (ConnectionError), and its late
        ones will never be answered. ``left``: it closed the link, as a peer that leaves does: it
        is in ``failed`` at once (sent nothing more until a new plan has it), so that neither its
        requests' failures nor a send to its closed link fail it as lost (no failure counted)."""
        with self._lock:
            if left:
                self.failed.add(peer)
                self.left.add(peer)
            lost = [self._pending.pop(rid) for rid, p in list(self._pending.items()) if p.peer == peer]
            self.forget(peer)
        for p in lost:
            if not p.future.done():
                p.future.set_exception(ConnectionError(reason))

    def expire(self, p: Pending, now: float, heard: float | None) -> Missed | None:
        """``p``'s wait ended with no answer (its deadline, or its link silent): unless an answer (or
        the link's loss) took it meanwhile — None then, and its future holds that — it is a miss,
        recorded in the same step (:meth:`missed`)."""
        with self._lock:
            if self._pending.pop(_rid(p), None) is None:
                return None
            why = self.missed(_rid(p), p.sent, now, heard)
            return Missed(why, self.of(p.peer).misses)

    def missed(self, rid: int, s: Sent, now: float, heard: float | None) -> str | None:
        """Request ``rid`` got no answer by its deadline (or its link went silent): count the miss
        and keep ``s`` for :meth:`late`. Returns why the peer fails, or None: it keeps its work."""
        with self._lock:
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
        with self._lock:
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
        with self._lock:
            self._late = {r: q for r, q in self._late.items() if q.peer != peer}

    # ------------------------------------------------------------------ whom to send to
    def may_send(self, peer: str, term: int, version: int, now: float, heard: float | None
                 ) -> tuple[bool, str | None]:
        """Whether to send ``peer`` a request of plan ``version`` of ``term`` at ``now``: not failed,
        not :meth:`suspect` (counted in ``withheld``) and not held as not ready (but for a probe
        now and then); and why it fails, when it is suspect and its link has also been silent
        ``SILENCE_S`` (:meth:`silence`), or None. ``heard``: when it was last heard."""
        with self._lock:
            if peer in self.failed:
                return False, None
            if self.suspect(peer, heard):
                self.withheld += 1
                why = self.silence(now, heard)
                return False, None if why is None else f"suspect since a missed request; {why}"
            held = self.not_ready.get(peer)
            if held is None:
                return True, None
            if held[:2] != (term, version):
                del self.not_ready[peer]  # a newer plan: it was sent that one before this request
                return True, None
            return now >= held[2], None

    def suspect(self, peer: str, heard: float | None) -> bool:
        """Whether ``peer`` is to be sent nothing now (module docstring, "Suspect"): a request it
        missed is still unanswered and it has not been heard since that request was sent
        (``heard``: when it was last heard; None: unknown, never suspect)."""
        with self._lock:
            return heard is not None and any(s.peer == peer and heard <= s.sent_at for s in self._late.values())

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

    def hold_not_ready(self, peer: str, term: int, version: int, now: float) -> bool:
        """``peer`` refused a request of plan ``version`` of ``term`` as not serving it: hold its
        requests of that plan until ``now + NOT_READY_RETRY_S`` (then one probe). Returns whether
        this is its first refusal of that plan."""
        with self._lock:
            first = self.not_ready.get(peer, (0, 0, 0.0))[:2] != (term, version)
            self.not_ready[peer] = (term, version, now + NOT_READY_RETRY_S)
            return first

    def fail(self, peer: str) -> bool:
        """``peer`` failed a request (module docstring, "Failed"): counted; returns whether it was
        not failed already (the owner is told once)."""
        with self._lock:
            if peer in self.left:
                return False  # it closed its link: what fails now is its leaving, not a fault
            self.of(peer).failures += 1
            if peer in self.failed:
                return False
            self.failed.add(peer)
            return True

    def distrust(self, peer: str, why: str) -> bool:
        """``peer`` answered wrong (``why``: the VerificationError's text): it fails, and stays
        failed whatever plan comes. Returns whether it was not failed already (:meth:`fail`)."""
        with self._lock:
            self.distrusted.setdefault(peer, why)
            return self.fail(peer)

    def verified(self, rows_answered: int, rows_checked: int = 0, rows_computed: int = 0,
                 seconds: float = 0.0) -> None:
        """Count an answer of ``rows_answered`` rows, of which ``rows_checked`` were checked by
        computing ``rows_computed`` here in ``seconds`` (:class:`VerifyCost`)."""
        with self._lock:
            v = self.verify_cost
            self.verify_cost = VerifyCost(v.answers + (rows_checked > 0), v.rows_checked + rows_checked,
                                          v.rows_computed + rows_computed, v.seconds + seconds,
                                          v.rows_answered + rows_answered)

    def readmit(self, peers: Iterable[str] | None = None) -> None:
        """A new plan: ``peers`` (None: every peer) may get work again — but those distrusted —
        and every miss count starts afresh."""
        with self._lock:
            if peers is None:
                self.failed.clear()
            else:
                self.failed.difference_update(peers)
            self.failed.update(self.distrusted)
            self.left &= self.failed
            for t in self.timing.values():
                t.misses = 0

    def observations(self) -> Observations:
        """A snapshot of what the answers showed (:class:`Observations`), for the cost model and status."""
        with self._lock:
            peers = {p: PeerObservation(t.rtt_s, t.s_per_row, t.requests, t.failures, t.misses, t.late,
                                        self.layer_timing[p].s_per_row_layer if p in self.layer_timing else None,
                                        self.message_overhead.get(p))
                     for p, t in self.timing.items()}
            # a peer that left is not shown as failed, unless a wrong answer distrusted it
            shown = self.failed - (self.left - set(self.distrusted))
            return Observations(peers, frozenset(shown), self.local_timing.s_per_row_layer,
                                self.verify_cost, dict(self.distrusted))


def _rid(p: Pending) -> int:
    return p.request.request_id


WAIT_SLICE_S = 0.5  # a wait looks at the link's silence this often
# A wait that finds it was not looked at for this long beyond its slice (the process stopped:
# SIGSTOP, a laptop's sleep) judges nothing from what it sees at once: the answer and the link's
# bytes may be waiting in the socket, unread. It gives the event loop STALL_GRACE_S to read them.
UNWATCHED_S = 1.0
STALL_GRACE_S = 0.5
LEAD_WAIT_S = 10.0  # a step waits this long at most for its coordinator to hear the swarm again
LEAD_POLL_S = 0.005


def wait_answer(tracker: RequestTracker, p: Pending, clock: Callable[[], float],
                last_heard: Callable[[str], float | None]) -> Any:
    """The answer to ``p`` (or the peer's :class:`Error`), waiting until its deadline or until the
    peer's link has been silent ``SILENCE_S`` (:meth:`RequestTracker.gone_silent`), whichever
    comes first; then :class:`Missed` (:meth:`RequestTracker.expire`), unless an answer came
    meanwhile. Raises ConnectionError when the link went away.

    A stall of this process (no look for ``UNWATCHED_S`` beyond the slice waited, counted from
    the request's sending) is not the peer's lateness or silence: what it sent meanwhile is
    read by the event loop once the process runs again, so the wait then lasts at least
    ``STALL_GRACE_S`` more, whatever the deadline and the link's last byte say (and as long as
    its deadline and the link allow, as any wait: a wait begun late, after the coordinator's own
    share, is not cut short)."""
    looked, slice_s, grace_until = p.sent_at, 0.0, None
    while True:
        now = clock()
        if grace_until is None and now - looked > slice_s + UNWATCHED_S:
            grace_until = now + STALL_GRACE_S  # this process stalled: unread bytes are no silence
        if grace_until is not None and now < grace_until:  # the grace only lengthens a wait
            slice_s = grace_until - now
        else:
            left = p.deadline - now
            if left <= 0 or RequestTracker.gone_silent(p.sent, now, last_heard(p.peer)):
                break
            slice_s = min(left, WAIT_SLICE_S)
        looked = now
        try:
            return p.future.result(timeout=slice_s)
        except cf.TimeoutError:
            pass
    missed = tracker.expire(p, clock(), last_heard(p.peer))
    return p.future.result() if missed is None else missed


def confirm_lead(lead_state: Callable[[], bool | None], clock: Callable[[], float],
                 sleep: Callable[[float], None] = time.sleep) -> None:
    """Return once ``lead_state()`` (the dispatcher's :meth:`Dispatcher.lead_state` of the
    step's term) is True — at once while it is. Raises CoordinatorChangedError when it turns
    False (deposed: the API hands its requests back with the same error), or when it stays
    None (leading without a majority heard) for ``LEAD_WAIT_S``: the election would have
    stepped down by then, so its event loop is stuck and the step must not hang."""
    state = lead_state()
    if state is True:
        return
    until = clock() + LEAD_WAIT_S
    while state is None and clock() < until:
        sleep(LEAD_POLL_S)
        state = lead_state()
    if state is True:
        return
    if state is None:
        raise CoordinatorChangedError(f"this coordinator has not heard from most of the swarm for {LEAD_WAIT_S:.0f} s "
                                      "and has not stepped down; send the request again to the current coordinator")
    raise CoordinatorChangedError.stepped_down()

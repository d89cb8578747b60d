"""Coordinator election: Raft's leader-election rules, sans-I/O.

Theory of operation
-------------------
Every Python peer runs one :class:`Election`. It never touches a socket or a
clock: the adapter feeds it messages and the current time (``receive``,
``handle_timer``) and drains what it wants sent (``messages_to_send``), the
events it raised (``next_event``) and when it next wants to be woken
(``get_timer``). The rules are Raft's (Ongaro & Ousterhout 2014, §5.2 and the
"disruptive servers" rule of §6) without the log, because the coordinator keeps
no replicated state: it only runs the token loop.

* Terms number elections. A peer votes at most once per term; a candidate that
  collects votes from a majority of the known voting members becomes the
  coordinator of that term, so there is at most one coordinator per term.
* The coordinator sends a :class:`LeaderHeartbeat` every ``HEARTBEAT_S``. A follower
  that hears none for its election timeout stands as a candidate. Only peers
  holding the model file (on disk; not in memory) are *eligible* to stand.
* Reachability is what the links say: the adapter calls :meth:`Election.heard_from`
  whenever a member's link carries anything (link heartbeats included), and every
  election message counts too. A member heard within ``REACHABLE_S`` is reachable;
  a coordinator whose heartbeats stopped for an election timeout is not, even if
  its link has not timed out yet (it is the one presumed dead).
* The most capable eligible peer wins when it is reachable: a peer's election
  timeout grows with its rank among the reachable eligible peers (rank 0 is the
  most capable), and a voter refuses a candidate when it knows a reachable
  eligible peer that is more capable (ties broken by peer id).
* Stable leadership (Raft thesis §9.6, PreVote, and leader stickiness): a candidate does not
  raise its own term when it stands; it asks for votes in the next term and moves to that term
  only when it wins it or learns from a voter that the term is in use. A member that heard its
  coordinator within ``ELECTION_TIMEOUT_S`` refuses vote requests (§6), answering with its term
  and not moving to the candidate's. So a peer cut off, stalled or restarted can stand as often
  as it likes without raising anyone's term: when it hears the coordinator again, their terms
  agree and it follows, and the coordinator is never told of a newer term that no majority took.
* A peer that wakes (its clock jumped: ``handle_timer`` or ``receive`` came ``WAKE_GAP_S``
  past the time :meth:`Election.get_timer` asked for, as after SIGSTOP/SIGCONT or a laptop's
  sleep) listens for one election timeout before it may stand: its links tell it first whether
  its coordinator lives.
* A coordinator steps down when the members it has not heard from within ``REACHABLE_S``
  are a majority, enough to elect another without it (check-quorum), so a coordinator cut
  off in a minority stops serving. In an even swarm split in half (two peers, one stalled)
  neither half can elect: the coordinator keeps serving, and its half keeps the API.

Terms and votes are not persisted across restarts. Raft persists them so a
restarted voter cannot vote twice in one term and so elect two leaders whose
logs diverge. Here there is no log: workers are stateless and answer each
request on its own, and every request carries its term, so a second coordinator
in one term could at worst serve its own requests correctly. To keep even that
out, a freshly started member stays a silent voter for ``startup_quiet_s`` (the driver
passes its ``MESH_FORMING_QUIET_S``, longer than any election round), so any election it
took part in before the restart has ended — with a leader it will then hear of, or in a
later term.

Membership: the quorum is a majority of the voting members known to this peer
(every Python peer, eligible or not; browser peers do not vote). A member whose
link goes quiet still counts (a crashed peer must not shrink the quorum, or two
partitions could each elect a leader); one that says goodbye is removed.
"""

from __future__ import annotations

import enum
import random
from collections import deque
from dataclasses import dataclass

from swarm.errors import LocalProtocolError, StaleTermError

# Named timing constants (seconds). Worst case after the coordinator dies: the
# survivors last heard it ≤ HEARTBEAT_S before, then the best-ranked survivor waits
# ELECTION_TIMEOUT_S + JITTER_S, then one vote round trip: ≈ 1.6 s; a refused or
# split round costs one more timeout — still inside the 5 s goal.
HEARTBEAT_S = 0.25  # coordinator heartbeats
REACHABLE_S = 2.5  # heard within this long → reachable (links beat every 1 s: two may be lost)
ELECTION_TIMEOUT_S = 1.0
RANK_STEP_S = 0.4  # each rank below the most capable waits this much longer
JITTER_S = 0.3  # uniform random extra, so equal ranks rarely collide
RESTART_QUIET_S = 0.0  # the core's default startup quiet: none (module docstring); the driver passes its own
WAKE_GAP_S = 1.0  # a call this long past the timer get_timer() gave means this process slept


class Role(enum.Enum):
    FOLLOWER = "follower"
    CANDIDATE = "candidate"
    LEADER = "leader"


@dataclass(frozen=True)
class LeaderHeartbeat:
    """``leader`` coordinates ``term`` and is alive (sent by the coordinator only)."""

    term: int
    leader: str


@dataclass(frozen=True)
class RequestVote:
    """``candidate`` asks for a vote in ``term`` (Raft §5.2)."""

    term: int
    candidate: str


@dataclass(frozen=True)
class Vote:
    """``voter``'s answer to a :class:`RequestVote` of ``term``."""

    term: int
    voter: str
    granted: bool


ElectionMessage = LeaderHeartbeat | RequestVote | Vote


@dataclass(frozen=True)
class LeaderChanged:
    """Event: ``leader`` coordinates ``term`` (``None``: no known coordinator, an election is due)."""

    term: int
    leader: str | None


@dataclass
class _Member:
    eligible: bool
    capability: float
    last_heard: float | None = None
    presumed_dead_at: float | None = None  # heard_from() evidence older than this is stale


def capability_key(capability: float, peer_id: str) -> tuple[float, str]:
    """Total order of peers by capability; the larger key is the more capable, ties by peer id."""
    return (capability, peer_id)


class Election:
    """One peer's view of the election; see the module docstring for the rules.

    ``rng`` draws the randomized timeouts (seed it in tests). ``now`` is seconds
    on any monotonic clock, the same one for every call.
    """

    def __init__(
        self,
        peer_id: str,
        *,
        eligible: bool,
        capability: float,
        now: float,
        rng: random.Random | None = None,
        startup_quiet_s: float = RESTART_QUIET_S,
    ) -> None:
        self.peer_id = peer_id
        self.eligible = eligible
        self.capability = float(capability)
        self.term = 0
        self.role = Role.FOLLOWER
        self.leader: str | None = None
        self.voted_for: str | None = None
        self._rng = rng or random.Random()
        self._members: dict[str, _Member] = {}
        self._votes: set[str] = set()
        self._leader_heard: float = now  # a fresh peer listens a full timeout before standing
        self._quiet_until = now + startup_quiet_s
        self._hold_until = float("-inf")  # no candidacy before this (see hold_candidacy)
        self._deadline = now + self._timeout()
        self._next_heartbeat = now
        self._standing: int | None = None  # the term a candidate asks votes for (its own term + 1)
        self._out: list[tuple[str | None, ElectionMessage]] = []
        self._events: deque[LeaderChanged] = deque()

    # ----------------------------------------------------------------- membership
    def add_member(self, peer_id: str, *, eligible: bool, capability: float, now: float) -> None:
        """Learn of a voting member (from its hello or a heartbeat); it counts toward the quorum."""
        if peer_id == self.peer_id:
            return
        m = self._members.get(peer_id)
        if m is None:
            self._members[peer_id] = _Member(eligible, float(capability), now)
        else:
            m.eligible, m.capability, m.last_heard = eligible, float(capability), now

    def remove_member(self, peer_id: str, now: float) -> None:
        """A member said goodbye: it no longer counts toward the quorum."""
        self._members.pop(peer_id, None)
        self._votes.discard(peer_id)
        if self.leader == peer_id:
            self._lose_leader(now)

    @property
    def members(self) -> list[str]:
        """Voting members known to this peer, itself included, sorted."""
        return sorted([self.peer_id, *self._members])

    def quorum(self) -> int:
        """Votes needed to win: a strict majority of :attr:`members`."""
        return len(self.members) // 2 + 1

    def heard_from(self, peer_id: str, now: float) -> None:
        """Anything arrived from ``peer_id`` (its link's heartbeat, any message): it is alive."""
        m = self._members.get(peer_id)
        if m is None or (m.presumed_dead_at is not None and now <= m.presumed_dead_at):
            return  # e.g. a link's last byte from before its coordinator went silent
        m.presumed_dead_at = None
        m.last_heard = now if m.last_heard is None else max(m.last_heard, now)

    def reachable(self, peer_id: str, now: float) -> bool:
        """True for ourselves and for members heard from within ``REACHABLE_S``."""
        if peer_id == self.peer_id:
            return True
        m = self._members.get(peer_id)
        return m is not None and m.last_heard is not None and now - m.last_heard <= REACHABLE_S

    def holds_quorum(self, now: float) -> bool:
        """Whether the members not heard from within ``REACHABLE_S`` are fewer than a quorum
        (check-quorum's test: otherwise they could elect without us). Safe to call from
        another thread (it reads a copy of the members)."""
        others = list(self._members)  # we are a member too
        return sum(not self.reachable(p, now) for p in others) < (len(others) + 1) // 2 + 1

    # ------------------------------------------------------------------- driving
    def receive(self, sender: str, msg: ElectionMessage, now: float) -> None:
        """Handle one message from ``sender`` (the authenticated link's peer id, not a field)."""
        if sender == self.peer_id:
            raise LocalProtocolError("an election message was looped back to its sender")
        self._note_time(now)
        self.heard_from(sender, now)
        match msg:
            case LeaderHeartbeat():
                self._on_heartbeat(sender, msg, now)
            case RequestVote():
                self._on_request_vote(sender, msg, now)
            case Vote():
                self._on_vote(sender, msg, now)
            case _:
                raise LocalProtocolError(f"not an election message: {type(msg).__name__}")

    def handle_timer(self, now: float) -> None:
        """Act on every deadline that has passed by ``now``."""
        self._note_time(now)
        if self.role is Role.LEADER:
            if not self.holds_quorum(now):
                self._lose_leader(now)  # check-quorum: those we cannot hear could elect without us
                return
            if now >= self._next_heartbeat:
                self._next_heartbeat = now + HEARTBEAT_S
                self._send(None, LeaderHeartbeat(self.term, self.peer_id))
            return
        if now >= self._deadline:
            self._presume_leader_dead(now)
            if self.leader is not None:
                self.leader = None
                self._events.append(LeaderChanged(self.term, None))
            if self.eligible and now >= max(self._quiet_until, self._hold_until):
                self._stand(now)
            else:
                self._deadline = now + self._timeout(now)

    def hold_candidacy(self, until: float) -> None:
        """Do not stand as a candidate before ``until`` (voting goes on as usual).

        The adapter holds a joining peer back while peers it can see are not linked yet: one
        of them may coordinate already, and a newcomer that stood alone would lead a quorum
        of one until it heard of it."""
        self._hold_until = max(self._hold_until, until)

    def get_timer(self) -> float:
        """The time at which :meth:`handle_timer` must next be called."""
        return self._next_heartbeat if self.role is Role.LEADER else self._deadline

    def messages_to_send(self) -> list[tuple[str | None, ElectionMessage]]:
        """Drain outgoing messages as ``(destination peer id, message)``; ``None`` = every member."""
        out, self._out = self._out, []
        return out

    def next_event(self) -> LeaderChanged | None:
        """Pop the next event, or ``None``."""
        return self._events.popleft() if self._events else None

    def check_term(self, term: int, now: float) -> None:
        """Validate the term of a plan or request from the coordinator.

        Raises :class:`StaleTermError` when ``term`` is older than ours. A newer
        term is adopted (we missed an election), as Raft does for any message.
        """
        if term < self.term:
            raise StaleTermError(f"term {term} is stale: this peer is in term {self.term}")
        if term > self.term:
            self._adopt_term(term, now)

    @property
    def standing_for(self) -> int | None:
        """The term a candidate asks votes for (None unless it is a candidate)."""
        return self._standing if self.role is Role.CANDIDATE else None

    # ------------------------------------------------------------------ internals
    def _note_time(self, now: float) -> None:
        """Called ``WAKE_GAP_S`` past our timer: this process slept. Whatever it knew of its
        coordinator is old news, but not evidence that it died: listen one election timeout
        (the coordinator's heartbeat, or a voter's term, comes within it) before standing."""
        if self.role is Role.LEADER or now - self._deadline < WAKE_GAP_S:
            return  # a coordinator that slept is checked by check-quorum on its next timer
        if self.role is Role.CANDIDATE:
            self.role, self._standing = Role.FOLLOWER, None
            self._votes.clear()
        self._leader_heard = now
        self._deadline = now + self._timeout()
        self._hold_until = max(self._hold_until, self._deadline)

    def _send(self, dest: str | None, msg: ElectionMessage) -> None:
        self._out.append((dest, msg))

    def _rank(self, now: float) -> int:
        """Our rank among reachable eligible peers other than the coordinator, 0 = most capable.

        The coordinator is left out: the rank decides who stands when it is gone.
        """
        mine = capability_key(self.capability, self.peer_id)
        return sum(
            1
            for p, m in self._members.items()
            if p != self.leader and m.eligible and self.reachable(p, now) and capability_key(m.capability, p) > mine
        )

    def _presume_leader_dead(self, now: float) -> None:
        """The coordinator's heartbeats stopped: count it unreachable until it is heard again
        (by anything newer than now: its link may still report bytes from before)."""
        m = self._members.get(self.leader) if self.leader else None
        if m is not None:
            m.last_heard, m.presumed_dead_at = None, now

    def _timeout(self, now: float | None = None) -> float:
        rank = 0 if now is None else self._rank(now)
        return ELECTION_TIMEOUT_S + rank * RANK_STEP_S + self._rng.uniform(0.0, JITTER_S)

    def _reset_deadline(self, now: float) -> None:
        self._deadline = now + self._timeout(now)

    def _adopt_term(self, term: int, now: float) -> None:
        was_leader = self.role is Role.LEADER
        # A candidate that stood for this very term voted for itself in it.
        self_vote = self.role is Role.CANDIDATE and self._standing == term
        self.term, self.voted_for, self.role = term, self.peer_id if self_vote else None, Role.FOLLOWER
        self._standing = None
        self._votes.clear()
        if self.leader is not None or was_leader:
            self.leader = None
            self._events.append(LeaderChanged(term, None))
        self._reset_deadline(now)

    def _lose_leader(self, now: float) -> None:
        self.role = Role.FOLLOWER
        self.leader = None
        self._leader_heard = float("-inf")
        self._events.append(LeaderChanged(self.term, None))
        self._reset_deadline(now)

    def _stand(self, now: float) -> None:
        """Ask for votes in the next term, staying in ours until a majority grants it (PreVote)."""
        self._standing = self.term + 1
        self.role = Role.CANDIDATE
        self._votes = {self.peer_id}
        if self.leader is not None:
            self.leader = None
            self._events.append(LeaderChanged(self.term, None))
        self._reset_deadline(now)
        self._send(None, RequestVote(self._standing, self.peer_id))
        self._maybe_win(now)

    def _maybe_win(self, now: float) -> None:
        if self.role is Role.CANDIDATE and self._standing is not None and len(self._votes) >= self.quorum():
            self.term, self.voted_for, self._standing = self._standing, self.peer_id, None
            self.role = Role.LEADER
            self.leader = self.peer_id
            self._events.append(LeaderChanged(self.term, self.peer_id))
            self._next_heartbeat = now  # announce at once
            self.handle_timer(now)

    def _leader_is_live(self, now: float) -> bool:
        return self.role is Role.LEADER or (
            self.leader is not None and now - self._leader_heard <= ELECTION_TIMEOUT_S
        )

    def _on_heartbeat(self, sender: str, hb: LeaderHeartbeat, now: float) -> None:
        if hb.term > self.term:
            self._adopt_term(hb.term, now)
        if hb.leader != sender:
            return
        if hb.term < self.term:
            # A coordinator of an older term (we moved on while cut off from it): tell it our
            # term, as Raft's AppendEntries reply does, so it steps down and an election
            # that includes us follows — otherwise we could never follow anyone again.
            self._send(sender, Vote(self.term, self.peer_id, False))
            return
        if self.role is Role.LEADER or (self.leader not in (None, sender)):
            # Two coordinators in one term can only come from peers that elected
            # themselves before they knew each other (a quorum of one). Move on
            # to a fresh term with no coordinator; its heartbeat tells the other.
            self._adopt_term(self.term + 1, now)
            return
        # The sender coordinates our term: follow it (a candidate gives up its round).
        self.role, self._standing = Role.FOLLOWER, None
        self._votes.clear()
        self._leader_heard = now
        if self.leader != sender:
            self.leader = sender
            self._events.append(LeaderChanged(self.term, sender))
        self._reset_deadline(now)

    def _on_request_vote(self, sender: str, rv: RequestVote, now: float) -> None:
        if rv.candidate != sender:
            return  # a vote request is only valid from the candidate itself
        if self._leader_is_live(now) or now < self._quiet_until:
            # §6: a working coordinator is not deposed by a rejoining peer. Refused with our term
            # (not silently): a restarted candidate learns it, and our term does not move.
            self._send(sender, Vote(self.term, self.peer_id, False))
            return
        self._presume_leader_dead(now)
        if rv.term > self.term:
            self._adopt_term(rv.term, now)
        granted = (
            rv.term == self.term
            and self.voted_for in (None, sender)
            and self._may_lead(sender, now)
        )
        if granted:
            self.voted_for = sender
            self._reset_deadline(now)
        self._send(sender, Vote(self.term, self.peer_id, granted))

    def _may_lead(self, candidate: str, now: float) -> bool:
        """Eligible, and no reachable eligible peer we know is more capable."""
        m = self._members.get(candidate)
        if m is None or not m.eligible:
            return False
        key = capability_key(m.capability, candidate)
        if self.eligible and capability_key(self.capability, self.peer_id) > key:
            return False
        return not any(
            o.eligible and p != candidate and self.reachable(p, now) and capability_key(o.capability, p) > key
            for p, o in self._members.items()
        )

    def _on_vote(self, sender: str, vote: Vote, now: float) -> None:
        if vote.voter != sender:
            return
        standing = self.role is Role.CANDIDATE and vote.term == self._standing
        if standing and vote.granted:
            self._votes.add(sender)
            self._maybe_win(now)
        elif vote.term > self.term:
            self._adopt_term(vote.term, now)  # a newer term is in use (or refused us in ours)

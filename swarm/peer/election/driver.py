"""The election driver: the asyncio adapter around the sans-I/O :class:`~swarm.peer.election.core.Election`.

It feeds the core with the node's links — every Python peer whose link opens becomes a voting
member, eligible when its hello names this swarm's model — with election messages
(``RequestVote``, ``Vote``, ``LeaderHeartbeat``) and with the links' liveness, sends what the
core wants sent, and hands each outcome (a term and its coordinator, or none) to the
``on_leader`` callback, which switches this peer's role.

Membership: a peer whose hello names another model is refused by name (logged, kept out of the
election, told with an ``Error`` of code ``model``); another model is another swarm in effect.
A peer with no model votes but cannot lead. A peer without a model of its own joins the swarm
of the model most of its Python peers hold. Members the signaling server no longer lists, and
whose link is silent, have left; a forgotten member whose link speaks again is back.

The driver owns the election's state; the roles read it through :attr:`term`, :attr:`leader`,
:meth:`leads`, :meth:`stalled`, :meth:`reachable`, :meth:`is_refused` and :meth:`check_sender`.
"""

from __future__ import annotations

import asyncio
import logging
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from swarm.errors import LocalProtocolError, RemoteProtocolError, StaleTermError
from swarm.peer.election import core as el
from swarm.peer.net.link_protocol import DEAD_AFTER_S, HEARTBEAT_S as LINK_HEARTBEAT_S
from swarm.peer.net.messages import Error, Hello, LeaderHeartbeat, RequestVote, Vote
from swarm.peer.tasks import OwnedTasks, send_logged

if TYPE_CHECKING:
    from swarm.peer.net.link import Link
    from swarm.peer.node import Node

log = logging.getLogger(__name__)

TICK_S = 0.05  # the driver wakes at least this often (seconds)
# A fresh peer neither stands nor votes this long (seconds): enough for the mesh to form, so
# peers that start together elect one coordinator instead of each leading a quorum of one.
MESH_FORMING_QUIET_S = 2.0
# A joining peer does not stand while Python peers it sees on signaling are not linked yet,
# for at most this long (seconds): one of them may coordinate already.
JOIN_GRACE_S = 10.0
LEFT_SILENCE_S = 2.0  # link silence (seconds) that, with no signaling presence, means a peer left
# After this process slept (SIGSTOP, a laptop lid; its ticks stopped for SLEPT_GAP_S or more),
# nobody is forgotten for this long (seconds): the peers that left our signaling server while we
# slept were not leaving the swarm: a peer that dropped our server tries it again within the
# rendezvous's DEAD_RETRY_S (5 s, in a stall of up to DEAD_PATIENCE_S), then moves to it (older
# servers win) within its RECHECK_S (2 s), with room to spare on a busy machine.
WAKE_GRACE_S = 15.0
# A stall this much shorter than the links' dead time (a busy machine's event loop, seen at 1-3 s
# with five peers on two cores) left every live peer's link to us open, even counting the silence
# of a heartbeat interval before it and one after: the live ones are heard again within
# LEFT_SILENCE_S of the stall's end, so silence counted from then tells the departed apart, and
# no grace (which would keep a dead coordinator's vote in the quorum for 15 s) is due.
SLEPT_GAP_S = DEAD_AFTER_S - 2 * LINK_HEARTBEAT_S


# After its ticks resume from a stall, how long a coordinator waits before its next step (its
# lead_state is None meanwhile): three of a coordinator's heartbeat intervals, within which a
# newer coordinator's heartbeat or a member's answer to ours naming a newer term arrives, and a
# margin for a busy machine. A swarm of one does not wait.
RESUME_CONFIRM_S = 3 * el.HEARTBEAT_S + 0.25


class ElectionDriver:
    """Runs the election over ``node``'s links (module docstring).

    ``holds_model``: whether this peer holds the model its hello names (without one it votes
    but cannot lead).
    ``on_leader(term, leader)``: awaited for each outcome (``leader`` None: an election is due).
    ``on_admitted(link)``: called when a Python peer becomes a member (again).
    """

    def __init__(self, node: Node, holds_model: bool, *,
                 on_leader: Callable[[int, str | None], Awaitable[None]],
                 on_admitted: Callable[[Link], None],
                 rng: random.Random | None = None, startup_quiet_s: float = MESH_FORMING_QUIET_S) -> None:
        self.node = node
        # The model this peer's swarm runs: its own, or (without one) the model most of its Python
        # peers hold — a peer without a model must not bridge two swarms of different models.
        self.swarm_model: str | None = node.hello.model_hash
        self._holds_model = holds_model
        self.core = el.Election(node.peer_id, eligible=self._holds_model, capability=node.hello.ffn_gflops,
                                now=time.monotonic(), rng=rng, startup_quiet_s=startup_quiet_s)
        self._refused: dict[str, str] = {}  # peer id → why it gets no work
        self._refusals_sent: set[str] = set()  # peers we told (and logged) why, whoever refused first
        self._on_leader, self._on_admitted = on_leader, on_admitted
        self._tasks = OwnedTasks("election")
        self._started = time.monotonic()  # reset by start()
        self._wake = asyncio.Event()
        self._last_tick: float | None = None
        self._woke_at = float("-inf")  # when this process last resumed after sleeping
        self._resumed_at = float("-inf")  # when its ticks last resumed after any stall

    # ------------------------------------------------------------------ what the roles read
    @property
    def term(self) -> int:
        return self.core.term

    @property
    def leader(self) -> str | None:
        return self.core.leader

    @property
    def role(self) -> str:
        """"coordinator", "worker" (another peer leads) or "peer" (no coordinator known)."""
        return {el.Role.LEADER: "coordinator"}.get(self.core.role, "worker" if self.core.leader else "peer")

    def leads(self, term: int) -> bool:
        """Whether this peer is the coordinator of ``term`` still."""
        return self.core.role is el.Role.LEADER and self.core.term == term

    def lead_state(self, term: int) -> bool | None:
        """Whether this peer still coordinates ``term``: True while it does and has heard from
        enough members to keep doing so (check-quorum), False once it does not, None in between
        — it leads, but a majority has been silent, or this process just stalled: its election
        either hears that it still leads or steps down. Safe to call from the token-loop thread.

        After a stall (SIGSTOP, a laptop's sleep) what the election holds predates it: the links
        read the bytes the members sent meanwhile, which count as hearing them although they may
        have elected another coordinator since. So None while its ticks have stopped for
        ``WAKE_GAP_S``, and for ``RESUME_CONFIRM_S`` after they resume: within that time the
        newer coordinator's heartbeat, or a member's answer to ours naming a newer term, reaches
        it and it steps down (a deposed coordinator that woke once finished its request there).
        A coordinator with no other member knows no one else could have been elected: no wait."""
        if not self.leads(term):
            return False
        if self.stalled():
            return None
        return True if self.core.holds_quorum(time.monotonic()) else None

    def stalled(self) -> bool:
        """Whether what the election holds may predate a stall of this process (SIGSTOP, a
        laptop's sleep) that it has not yet heard the swarm after: its ticks have stopped for
        ``WAKE_GAP_S``, or resumed less than ``RESUME_CONFIRM_S`` ago. Meanwhile the members it
        counts as unreachable may be well and have elected another coordinator: nothing is to
        be planned from that view. Never when it is the only member (no one else could have
        been elected)."""
        now = time.monotonic()
        if len(self.core.members) == 1:
            return False
        return ((self._last_tick is not None and now - self._last_tick > el.WAKE_GAP_S)
                or now - self._resumed_at < RESUME_CONFIRM_S)

    def reachable(self, peer: str) -> bool:
        """Whether ``peer`` is a member heard from recently enough to count."""
        return self.core.reachable(peer, time.monotonic())

    def is_refused(self, peer: str) -> bool:
        """Whether ``peer`` was refused (another model): it gets no vote and no work."""
        return peer in self._refused

    def check_sender(self, peer: str, term: int, what: str) -> None:
        """A plan of ``term`` came from ``peer``: raises StaleTermError when the term is stale or
        another peer coordinates it (``what`` names the plan in the message). A stale term is
        also answered with our term (see :meth:`check_term`)."""
        self.check_term(term, peer)
        if peer != self.core.leader and term == self.core.term and self.core.leader:
            raise StaleTermError(f"{what} from {peer}, but {self.core.leader} coordinates term {term}")

    def check_term(self, term: int, peer: str | None = None) -> None:
        """Raises StaleTermError when a request or plan of ``term`` is stale. When ``peer`` sent
        it, it is also told our term, as Raft's replies do: a refused ``Vote`` of the current
        term, on which a deposed coordinator steps down at once instead of waiting for its
        requests' deadlines (the ``Error`` the caller sends names no term)."""
        try:
            self.core.check_term(term, time.monotonic())
        except StaleTermError:
            if peer is not None:
                self._tell_term(peer)
            raise

    def _tell_term(self, peer: str) -> None:
        link = self.node.links.get(peer)
        if link is not None:
            self._tasks.spawn(send_logged(link, Vote(self.core.term, False)), "tell-term")

    # ------------------------------------------------------------------ life cycle
    def start(self) -> None:
        """Take the election's messages and the node's Python links; start the driver task."""
        self._started = time.monotonic()
        n = self.node
        n.on(RequestVote, self._on_request_vote)
        n.on(Vote, self._on_vote)
        n.on(LeaderHeartbeat, self._on_leader_heartbeat)
        n.on_link_up.append(self.link_up)
        for link in list(n.links.values()):
            self.link_up(link)
        self._tasks.spawn(self._drive(), "driver")

    async def stop(self) -> None:
        await self._tasks.close()

    async def _drive(self) -> None:
        """Must outlive any one bad tick, or this peer would never elect again."""
        failures = 0
        while True:
            try:
                await self._tick()
                failures = 0
            except Exception:
                failures += 1
                if failures == 1:
                    log.exception("election tick failed; going on")
                await asyncio.sleep(TICK_S)

    async def _tick(self) -> None:
        """One round: liveness and membership from the links, the election's timers, its messages."""
        now = time.monotonic()
        self._note_tick(now)
        for peer, link in list(self.node.links.items()):
            self.core.heard_from(peer, link.last_heard)  # any inbound byte, link heartbeats included
        self._forget_departed(now)
        self._readmit_returned(now)
        if now < self._started + JOIN_GRACE_S and self._unlinked_peers():
            self.core.hold_candidacy(now + TICK_S)
        self.core.handle_timer(now)
        await self._flush()
        self._wake.clear()
        delay = min(max(self.core.get_timer() - time.monotonic(), 0.0), TICK_S)
        try:
            await asyncio.wait_for(self._wake.wait(), delay)
        except TimeoutError:
            pass

    def _note_tick(self, now: float) -> None:
        """A tick more than ``WAKE_GAP_S`` after the last one: this process stalled; one
        ``SLEPT_GAP_S`` or more after it: it slept."""
        gap = now - self._last_tick if self._last_tick is not None else 0.0
        if gap > el.WAKE_GAP_S:
            self._resumed_at = now
            if gap >= SLEPT_GAP_S:
                self._woke_at = now
                log.info("this process's ticks stopped for %.1f s (it slept): no member is forgotten "
                         "for %g s", gap, WAKE_GRACE_S)
            else:
                log.info("this process's ticks stopped for %.1f s (a busy machine)", gap)
        self._last_tick = now

    async def _flush(self) -> None:
        """Send what the election wants sent, then act on its events."""
        e = self.core
        for dest, msg in e.messages_to_send():
            wire: LeaderHeartbeat | RequestVote | Vote
            match msg:
                case el.LeaderHeartbeat():
                    wire = LeaderHeartbeat(msg.term, msg.leader)
                case el.RequestVote():
                    wire = RequestVote(msg.term, msg.candidate)
                case el.Vote():
                    wire = Vote(msg.term, msg.granted)
                case _:
                    raise LocalProtocolError(f"election wants to send a {type(msg).__name__}: "
                                             "only LeaderHeartbeat, RequestVote and Vote go on the wire")
            targets = [dest] if dest else [p for p in e.members if p != self.node.peer_id]
            for peer in targets:
                link = self.node.links.get(peer)
                if link is not None:
                    self._tasks.spawn(send_logged(link, wire), "send")
        while (event := e.next_event()) is not None:
            log.info("term %d: coordinator %s", event.term, event.leader or "none (election due)")
            await self._on_leader(event.term, event.leader)

    # ------------------------------------------------------------------ messages
    def _receive(self, link: Link, msg: el.RequestVote | el.Vote | el.LeaderHeartbeat) -> None:
        peer = link.peer_id
        if peer is None or peer not in self.core.members:
            return  # refused peers (another model) and browser peers take no part in the election
        try:
            self.core.receive(peer, msg, time.monotonic())
        except RemoteProtocolError as exc:
            log.warning("election message from %s refused: %s", peer, exc)
        self._wake.set()

    def _on_request_vote(self, link: Link, msg: RequestVote) -> None:
        self._receive(link, el.RequestVote(msg.term, msg.candidate))

    def _on_vote(self, link: Link, msg: Vote) -> None:
        self._receive(link, el.Vote(msg.term, _remote(link)[0], msg.granted))

    def _on_leader_heartbeat(self, link: Link, msg: LeaderHeartbeat) -> None:
        self._receive(link, el.LeaderHeartbeat(msg.term, msg.leader))

    def refused_by(self, link: Link, msg: Error) -> None:
        """A channel-level ``Error`` (request id 0) from ``link``'s peer: one of code ``model``
        says it runs another model, so it will never vote for us."""
        peer, _ = _remote(link)
        log.warning("peer %s: %s: %s", peer, msg.code, msg.message)
        if msg.code == "model":
            self._refused.setdefault(peer, msg.message)
            self.core.remove_member(peer, time.monotonic())

    # ------------------------------------------------------------------ membership
    def link_up(self, link: Link) -> None:
        """A Python peer's link opened: weigh the swarm's model again (without one), admit it."""
        hello = link.hello
        if hello is None or hello.peer_kind != "python":
            return  # browser peers link to the coordinator only: they compute but do not vote
        if not self._holds_model and self._choose_model():
            return  # every link, this one included, was weighed again
        self._admit(link)

    def _admit(self, link: Link) -> None:
        """Make a Python peer a voting member (eligible when it holds this swarm's model), or
        refuse it by name when it holds another model."""
        peer, hello = _remote(link)
        if self._refuse_other_model(link):
            return
        eligible = hello.model_hash is not None and self.swarm_model in (None, hello.model_hash)
        self.core.add_member(peer, eligible=eligible, capability=hello.ffn_gflops, now=time.monotonic())
        self._on_admitted(link)
        self._wake.set()

    def _choose_model(self) -> bool:
        """Without a model: this swarm's model is the one most linked Python peers hold (ties keep
        the current choice). Returns True when the choice changed and every peer was re-admitted."""
        counts = Counter(link.hello.model_hash for link in self.node.links.values()
                         if link.hello is not None and link.hello.peer_kind == "python" and link.hello.model_hash)
        if not counts:
            return False
        best = max(counts, key=lambda h: (counts[h], h == self.swarm_model))
        if best == self.swarm_model:
            return False
        log.info("joining the swarm of model %s… (held by %d peer(s))", best[:12], counts[best])
        self.swarm_model = best
        for link in list(self.node.links.values()):
            if link.hello is not None and link.hello.peer_kind == "python":
                if link.hello.model_hash in (None, best):
                    peer, _ = _remote(link)
                    self._refused.pop(peer, None)
                    self._refusals_sent.discard(peer)
                self._admit(link)
        return True

    def _refuse_other_model(self, link: Link) -> bool:
        """Refuse ``link``'s peer by name if it holds another model than this swarm runs (a
        member that could never vote for us would only block the quorum)."""
        peer, hello = _remote(link)
        if hello.model_hash is None or self.swarm_model is None or hello.model_hash == self.swarm_model:
            return False
        why = (f"peer {hello.name!r} ({peer}) holds model {hello.model_hash[:12]}…, "
               f"this swarm runs {self.swarm_model[:12]}…")
        if peer not in self._refusals_sent:  # the remote's own refusal may have come first
            self._refusals_sent.add(peer)
            self._refused[peer] = why
            log.warning("refused %s", why)
            self._tasks.spawn(send_logged(link, Error(0, "model", f"refused: {why}")), "refuse")
        self.core.remove_member(peer, time.monotonic())
        return True

    def _unlinked_peers(self) -> set[str]:
        """Python peers on our signaling server with no open link to us yet (refused ones aside)."""
        present = getattr(self.node.rendezvous, "peers", None) or {}
        return {p for p, info in present.items()
                if info.kind == "python" and p != self.node.peer_id and p not in self.node.links
                and p not in self._refused}

    def _forget_departed(self, now: float) -> None:
        """Members the signaling server no longer lists, whose link is closed or silent for
        ``LEFT_SILENCE_S``, have left (a killed process drops its signaling connection at once;
        its link only times out later): they stop counting toward the quorum, so the
        survivors of a small swarm can still elect.

        A peer cut off by the network (not by leaving) stays listed by the signaling server of
        its side and keeps counting. For ``WAKE_GRACE_S`` after this process slept (its ticks
        stopped for ``SLEPT_GAP_S`` or more) nobody is forgotten: had it hosted signaling, the
        others left its server because it stopped answering, and one that forgot the coordinator
        would lead alone on waking (once: a stage peer stalled 10 s took the coordinator's role,
        in a new term on another port). After a shorter stall, silence counts from its end, and
        no grace is due: one kept a killed coordinator in the quorum for 15 s.
        If a partition also splits signaling, each side ends up with its own coordinator; each
        holds the whole model, so each still gives the right tokens, and the sides merge again
        through the election when they meet.
        """
        present = getattr(self.node.rendezvous, "peers", None)
        if not present:
            return  # between signaling servers: we are the one cut off, not them
        if now - self._woke_at < WAKE_GRACE_S:
            return  # we slept: those who left our server meanwhile left us, not the swarm
        for peer in self.core.members:
            if peer == self.node.peer_id or peer in present:
                continue
            link = self.node.links.get(peer)
            heard = link.last_heard if link is not None else None
            # silence counts from the end of our own last stall: we heard nothing while stalled
            if heard is None or now - max(heard, self._resumed_at) > LEFT_SILENCE_S:
                log.info("peer %s left the swarm", peer)
                self.core.remove_member(peer, now)

    def _readmit_returned(self, now: float) -> None:
        """A peer forgotten by :meth:`_forget_departed` whose link stayed open and speaks again
        (it was stalled, or cut off for less than the link timeout) is a member again: its
        link never went down, so no link-up event would bring it back."""
        for peer, link in list(self.node.links.items()):
            hello = link.hello
            if (hello is None or hello.peer_kind != "python" or peer in self.core.members
                    or peer in self._refused or now - link.last_heard > LEFT_SILENCE_S):
                continue
            log.info("peer %s is back", peer)
            self._admit(link)


def _remote(link: Link) -> tuple[str, Hello]:
    """An open link's peer id and Hello (both are set once a link opens; the election hears only
    open links)."""
    if link.peer_id is None or link.hello is None:
        raise LocalProtocolError(f"the link is not open ({link.state.value}): no peer id or Hello yet")
    return link.peer_id, link.hello

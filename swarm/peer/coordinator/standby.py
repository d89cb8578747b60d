"""Why a plan gives a page no work, as a :class:`~swarm.peer.net.messages.Standby` notice: a
reason code and one sentence for the page's status line. Pure: the role hands it the plan, the
pages linked to the coordinator and what the planner chose, and sends what it returns.

A page gets work only in per-layer ranges (it runs no attention, so no stage). It stands by when
the layout chosen is not ranges (``auto`` priced the Python peers faster without it:
``fits_python_peers``; ``stages`` or ``mix`` asked for: ``layout_excludes_pages``), or, under
ranges, when placement gave it nothing (no speed or a share that rounds to nothing:
``too_slow``; a round trip past :data:`~swarm.peer.coordinator.planner.MAX_RTT_S`:
``slow_link``; no room for one expert or column: ``too_little_memory``). A page left out before
planning (no memory offered, marked down for late or wrong answers, or computing float32 for a
coordinator of the int8 numerics: ``other_numerics``) says so too.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable, Mapping
from swarm.peer.coordinator.planner import MAX_RTT_S, PeerCapacity
from swarm.peer.net.messages import STANDBY_MESSAGE_MAX, NumericBuild, Standby, StandbyReason
from swarm.peer.plan import ModelShape, Plan

NOTICES_PREFIX = "notices:"  # the word of a page's build.blas that lists the notices it reads
READS_STANDBY = "standby"
# Reasons added after the first set: a page names each it reads (``notices:standby,other_numerics``);
# one that reads Standby but not the reason would refuse the frame as malformed and drop its link.
LATER_REASONS = ("other_numerics",)


def reads_standby(build: NumericBuild, reason: str | None = None) -> bool:
    """Whether a Hello's ``build`` names ``notices:standby`` in ``blas`` and, for a reason of
    :data:`LATER_REASONS`, that reason too: pages that do not (older ones) are sent no such
    Standby, which they would refuse as an unknown kind or reason."""
    named = build.named(NOTICES_PREFIX)
    return READS_STANDBY in named and (reason not in LATER_REASONS or reason in named)


def _gib(n: int) -> str:
    return f"{n / 2**30:,.1f} GiB"


def _reason_in_ranges(page: PeerCapacity, shape: ModelShape) -> tuple[StandbyReason, str]:
    """Why placement over ranges (:func:`~swarm.peer.coordinator.planner.build_plan`) gave ``page`` nothing."""
    if page.rtt_s > MAX_RTT_S:
        return "slow_link", f"this page's round trip to the coordinator ({page.rtt_s:.1f} s) would stall every layer"
    held = shape.worker_weight_budget(page.memory_bytes)
    e, c = shape.unit_bytes(page.kind)
    units = [u for u in (e if shape.n_experts and shape.moe_layers else 0,
                         c * max(shape.dense_block, 1) if shape.dense_layers else 0) if u > 0]
    if held <= 0 or (units and held < min(units)):
        return "too_little_memory", (f"this page's memory ({_gib(page.memory_bytes)} offered) holds no expert "
                                     "or MLP slice of this model")
    return "too_slow", f"this page's measured speed ({page.ffn_speed:.1f} GFLOP/s) would slow the swarm"


def notices(plan: Plan, pages: Iterable[str], planned: Mapping[str, PeerCapacity], *, layout: str,
            choice: str | None, shape: ModelShape, python_peers: int, python_bytes: int,
            marked_down: Collection[str] = (), other_numerics: Collection[str] = (),
            numerics: str = "float32") -> dict[str, Standby]:
    """A Standby for each of ``pages`` (browser peers linked to the coordinator) that ``plan``
    gives no work; none for a page that has work.

    ``planned``: the peers offered to the planner (a page absent from it was left out before
    planning: ``marked_down`` ones for failed requests, ``other_numerics`` ones for computing
    other numerics than the coordinator's ``numerics``, the others for offering no memory).
    ``layout``: the one asked for; ``choice``: the one the cost model took (``"local"``,
    ``"ranges"``, ``"stages"``, ``"mix"``; None: ranges asked for). ``python_peers``,
    ``python_bytes``: the Python peers that can hold the model (the coordinator included) and
    the memory they offer (bytes), for ``fits_python_peers``'s sentence.
    """
    busy = set(plan.workers())
    out = {}
    for peer in pages:
        if peer in busy:
            continue
        page = planned.get(peer)
        reason: StandbyReason
        if page is None:
            if peer in other_numerics:
                reason, text = "other_numerics", (f"this swarm's coordinator computes with the {numerics} numerics, "
                                                  "which this page's kernels do not give")
            elif peer in marked_down:
                reason, text = "failed_recently", ("this page's answers came late or wrong; it is tried again "
                                                   "in a few seconds")
            else:
                reason, text = "too_little_memory", "this page offers no memory for weights"
        elif (choice or "ranges") != "ranges":
            if layout == "auto":
                s = "" if python_peers == 1 else "s"
                reason, text = "fits_python_peers", (f"the model fits the Python peers ({python_peers} peer{s}, "
                                                     f"{_gib(python_bytes)} offered); this page would be used if "
                                                     "they ran short")
            else:
                reason, text = "layout_excludes_pages", (f"the swarm runs --layout {layout}, which gives work only "
                                                         "to Python peers that hold the model")
        else:
            reason, text = _reason_in_ranges(page, shape)
        out[peer] = Standby(term=plan.term, version=plan.version, reason=reason, message=text[:STANDBY_MESSAGE_MAX])
    return out

"""The contract both roles share: the plan the coordinator hands out and the workers serve.

:class:`Plan` and its :class:`Span` s (which peer computes which experts and dense columns of
each layer, plan), :class:`ModelShape` (the model's sizes the plans are cut to, shape) and the
stage layout (:class:`StageLayout` of :class:`Stage` s, :func:`split_layers`; a plan's workers and
what each holds under both, :func:`plan_workers`, :func:`held_bytes`; stages). Pure: no
file, clock or socket; making a plan is the coordinator's (:mod:`swarm.peer.coordinator.planner`),
reading a model's sizes the weights' (:mod:`swarm.peer.weights.sizes`).

May import swarm.errors, swarm.peer.memory and swarm.peer.net.messages; nothing of either role.
"""

from swarm.peer.plan.plan import Plan, Span, check_plan
from swarm.peer.plan.shape import Q8_0_BYTES, ModelShape, gpu_holds, reserve_of
from swarm.peer.plan.stages import INLINE_ROWS, Stage, StageLayout, held_bytes, plan_workers, split_layers

__all__ = ["INLINE_ROWS", "Q8_0_BYTES", "ModelShape", "Plan", "Span", "Stage", "StageLayout", "check_plan",
           "gpu_holds", "held_bytes", "plan_workers", "reserve_of", "split_layers"]

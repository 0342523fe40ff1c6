"""``ckpt_ext.plan``: given a memory budget in bytes, the least recompute that fits — per unit, a
row of the options table: leave it, fuse it (``ckpt_ext.fuse``), checkpoint the block (stock
``torch.utils.checkpoint``), recompute its pointwise work (selective checkpointing), or fuse and
recompute the pointwise rest — and ``ckpt_ext.max_batch``, the largest batch whose planned step
fits.

Stages, one module each: units (what can be chosen: the options table) → probe (marked steps on a
copy that rebind makes callable as the model is called) → measure (the probes a plan needs) →
figures (the step as a chain of units; predictions) → solver (the exact choice) → choose → result
(the Plan, and ``Plan.apply``); recompute (pointwise recompute's policy and forward); compiled
(planning for a compiled step); batch (``max_batch``); step (the training step and its
measurement). Design: docs/plan.md."""
from .api import max_batch, plan
from .result import Applied, Plan, PlanReport
from .step import measure_step
from .units import Option

__all__ = ["plan", "max_batch", "Plan", "PlanReport", "Applied", "Option", "measure_step"]

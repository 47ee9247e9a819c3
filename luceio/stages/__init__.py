"""Pipeline stages: one model cut into contiguous layer ranges, one process per range, joined by
torch.distributed (`plan.py` checks the split, `group.py` is the engine's side, `worker.py` a
further stage's, `wire.py` what crosses between them)."""
from .group import StageError, StageGroup
from .plan import StagePlan, layer_ranges, plan_stages

__all__ = ["StageError", "StageGroup", "StagePlan", "layer_ranges", "plan_stages"]

"""Pipeline stages: one model cut into contiguous layer ranges, one process per range, joined by
torch.distributed (`plan.py` checks the split, `group.py` is the engine's side, `worker.py` a
further stage's, `wire.py` what crosses between them)."""
from ..loader.resolve import model_path
from .group import StageError, StageGroup
from .plan import StagePlan, layer_ranges, plan_stages

__all__ = ["StageError", "StageGroup", "StagePlan", "layer_ranges", "plan_stages", "start_stages"]


def start_stages(args, ckpt, model) -> StageGroup | None:
    """The pipeline stages of a `--devices` run, started (the engine's process is rank 0);
    None for one device. `ckpt` / `model`: what the engine loads (a model object cannot be
    loaded again by the other stages, so it is refused)."""
    from ..models import model_config  # a multimodal config nests the text model's
    plan = plan_stages(args, model_config(ckpt.config).num_layers if ckpt is not None
                       else model.cfg.num_layers)
    if plan is None:
        return None
    if args.rank != 0:
        raise ValueError(f"--rank {args.rank} is a stage's, not the engine's (rank 0): start it "
                         "with `luceio stage`")
    if ckpt is None:
        raise ValueError("pipeline stages load the checkpoint in every stage: pass the model "
                         "path, not a model object")
    return StageGroup(plan, args, model_path(args.model))

"""Where a staged step's time goes, per stage: with `LUCEIO_STAGE_TIMING=PREFIX` in the
environment, every stage adds up its steps' phases and writes `PREFIX.stage<rank>.json` when it
ends: {kind: {"steps": n, "us_per_step": {phase: mean µs}}} for the kinds of step
`step_kind` tells apart; bench/stages_bench.py reads them into its rows. Without it nothing is
timed (the phases are then one attribute test each).

Phases, in each stage's order:
- stage 0 (`StageGroup.forward`): pack (the step's ints, packed and sent ahead), layers (its
  eager layers' launches; a step that replays stage 0's CUDA graph queued it before, outside
  these phases), send (the hidden states' copy to the host waits for the layers on a GPU, then
  their message), final (waiting for the last stage's hidden states: the later stages' time
  plus the transfers);
- a later stage (`worker._serve`): wait (idle until the step's ints arrive), prepare (relaying
  them on, filling its graph's inputs), recv (waiting for the hidden states: the stage
  before's layers), layers, send."""
from __future__ import annotations

import json
import os
import time

ENV = "LUCEIO_STAGE_TIMING"


def step_kind(num_seqs: int, max_query_len: int) -> str:
    """decode_b1 (one request, one token), decode (several, one token each) or other."""
    if max_query_len != 1:
        return "other"
    return "decode_b1" if num_seqs == 1 else "decode"


class PhaseTimer:
    def __init__(self, rank: int):
        prefix = os.environ.get(ENV)
        self.path = f"{prefix}.stage{rank}.json" if prefix else None
        self.totals: dict[str, dict[str, float]] = {}  # kind -> phase -> seconds
        self.steps: dict[str, int] = {}
        self._step: dict[str, float] = {}  # this step's phases
        self._t = 0.0

    def start(self) -> None:
        if self.path is not None:
            self._t = time.perf_counter()
            self._step = {}

    def mark(self, phase: str) -> None:
        """The time since the last mark (or `start`) goes to `phase`."""
        if self.path is not None:
            t = time.perf_counter()
            self._step[phase] = self._step.get(phase, 0.0) + t - self._t
            self._t = t

    def step(self, phase: str, kind: str) -> None:
        """The last phase of a step of `kind` (`step_kind`): the step counts as one."""
        if self.path is not None:
            self.mark(phase)
            totals = self.totals.setdefault(kind, {})
            for k, v in self._step.items():
                totals[k] = totals.get(k, 0.0) + v
            self.steps[kind] = self.steps.get(kind, 0) + 1

    def write(self) -> None:
        if self.path is None or not self.steps:
            return
        with open(self.path, "w") as f:
            json.dump({kind: {"steps": n, "us_per_step": {
                k: round(1e6 * v / n, 1) for k, v in self.totals[kind].items()}}
                for kind, n in self.steps.items()}, f)

"""Record every microbatch's forward and backward of chosen training steps, for the pipeline timeline.

Each rank appends one JSON line per recorded step to ``<run dir>/pipeline_events/rank<R>.jsonl``: the step,
the rank, its coordinates in the layout, the schedule and its events (the engine's :class:`PipelineEvent`:
``kind`` F/B, ``chunk``, ``virtual_stage``, ``microbatch``, ``start``, ``end`` in ``time.time()`` seconds).
``megatron-lite pipeline-timeline RUN_DIR`` reads them back, prints the measured bubble beside the theory
and draws the PNG (:mod:`megatron_lite.cli.pipeline_timeline`, reading them with
:mod:`megatron_lite.core.parallel.pipeline.timeline`).

Recording is cheap (two clock reads per forward and backward, one small file append per step) and the
engine records only on the steps chosen here.
"""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path
from typing import Iterable, Optional, Union

import lightning.pytorch as pl
from lightning.pytorch.utilities import rank_zero_warn

from megatron_lite.core.parallel.pipeline.timeline import EVENTS_DIR


class PipelineTimeline(pl.Callback):
    """Write this rank's pipeline events of chosen training steps under ``<run dir>/pipeline_events/``.

    Args:
        dirpath: the run directory (default: the Trainer's ``log_dir``); events go to its ``pipeline_events/``.
        steps: optimizer steps (0-based, Lightning's ``global_step``) to record; None: every ``every_n_steps``.
        every_n_steps: record steps ``0, n, 2n, ...`` (when ``steps`` is None).

    Needs a module trained by the megatron-lite engine (``GPTModule`` or one with an ``engine`` and a
    ``parallel_layout``) under ``MegatronStrategy(pipeline_model_parallel_size > 1)``; without pipeline
    parallelism there is no schedule to draw and nothing is recorded (with a warning).
    """

    def __init__(
        self, dirpath: Optional[Union[str, Path]] = None, steps: Optional[Iterable[int]] = None, every_n_steps: int = 1
    ) -> None:
        if not isinstance(every_n_steps, int) or isinstance(every_n_steps, bool) or every_n_steps < 1:
            raise ValueError(f"every_n_steps must be a positive integer, got {every_n_steps!r}")
        self.dirpath = Path(dirpath) if dirpath is not None else None
        self.steps = None if steps is None else {int(s) for s in steps}
        self.every_n_steps = every_n_steps
        self.path: Optional[Path] = None
        """This rank's events file (set at fit start)."""
        self._run: Optional[float] = None
        self._recording: Optional[int] = None
        """The step being recorded (None while not recording)."""

    def records(self, step: int) -> bool:
        """Whether optimizer step ``step`` is recorded."""
        return step in self.steps if self.steps is not None else step % self.every_n_steps == 0

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit":
            return
        # dir(), not hasattr(): GPTModule.engine is a property that raises until the model is built
        if not {"engine", "parallel_layout"} <= set(dir(pl_module)):
            raise TypeError(
                f"PipelineTimeline records the megatron-lite engine's schedule; {type(pl_module).__name__} "
                f"has no `engine` and `parallel_layout` (train a GPTModule, or a module built on "
                f"megatron_lite.core.engine.TrainingEngine)"
            )
        # One directory and one run id for every rank: rank 0's (log_dir is itself broadcast from rank 0).
        dirpath = self.dirpath if self.dirpath is not None else Path(trainer.log_dir or trainer.default_root_dir)
        dirpath, self._run = trainer.strategy.broadcast((str(dirpath), time.time()), src=0)
        layout = pl_module.parallel_layout
        if layout.pp_size == 1:
            rank_zero_warn(
                "PipelineTimeline: pipeline_model_parallel_size is 1, so there is no pipeline schedule "
                "to record; nothing is written"
            )
            self.path = None
            return
        self.path = Path(dirpath) / EVENTS_DIR / f"rank{trainer.global_rank}.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        # Set on every step, not once: the module may rebuild its engine, and other steps stay unrecorded.
        step = trainer.global_step  # the optimizer step this batch takes
        self._recording = step if self.path is not None and self.records(step) else None
        pl_module.engine.record_events = self._recording is not None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if self._recording is None:
            return
        step, self._recording = self._recording, None
        engine = pl_module.engine
        engine.record_events = False  # validation and predict run the engine too: keep their steps out
        layout = pl_module.parallel_layout
        events = engine.events
        record = {
            "run": self._run,
            "step": step,
            "rank": trainer.global_rank,
            "coords": {dim: int(value) for dim, value in layout.coords.items()},
            "pp_size": layout.pp_size,
            "virtual_pipeline_size": len(engine.parts),
            "schedule": layout.config.schedule,
            "num_microbatches": len({e.microbatch for e in events}),
            "events": [dataclasses.asdict(e) for e in events],
        }
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

"""The pipeline events of recorded training steps, read back, and their bubble beside the schedule's theory.

:class:`megatron_lite.callbacks.PipelineTimeline` writes ``RUN_DIR/pipeline_events/rank<R>.jsonl``: one line per
recorded step and rank, holding that rank's events (:class:`PipelineEvent`: kind ``F``/``B``/``W``, model chunk,
virtual stage, microbatch, wall-clock ``start``/``end`` in ``time.time()`` seconds, ``start`` taken once the
input had arrived). ``megatron-lite pipeline-timeline`` (:mod:`megatron_lite.cli.pipeline_timeline`) prints and
draws what is read here; ``benchmarks/pipeline.py`` checks the bubble against the theory.

**Measured bubble** of one step: its span runs from the first forward's start to the last backward's (or weight
pass's) end across the pipeline; a stage's bubble is ``1 - busy / span`` (busy: the sum of its events' durations), and
the step's bubble is the mean over the stages. **Theory** (equal stage times, no communication cost):
1F1B and GPipe ``(P - 1) / (M + P - 1)``, interleaved 1F1B ``(P - 1) / (V·M + P - 1)`` for P stages,
M microbatches and V model chunks per stage; ZB-H1 ``(P - 1) / (3M + P - 1)`` when forward, input-gradient
backward and weight-gradient pass take equal time (a third of 1F1B's for M >> P: Qi et al. 2024), ZB-V and DualPipeV
``(P - 1) / (6M + P - 1)``.

Every rank's events are in one picture only when the ranks share a clock (one machine, or clocks kept in
sync by NTP to well under a microbatch). With several pipelines (data, tensor or context parallel
replicas), the one of data/tensor/context rank 0 is read.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from megatron_lite.core.parallel.pipeline.schedules import PipelineEvent

EVENTS_DIR = "pipeline_events"
# The pipeline replica drawn when data/tensor/context parallelism makes several: coordinates other than pp.
REPLICA = {"dp": 0, "tp": 0, "cp": 0}


class TimelineError(ValueError):
    """A problem the user can fix; the message says how."""


def _how_to_record() -> str:
    return (
        "record them with Trainer(callbacks=[megatron_lite.callbacks.PipelineTimeline()]) under "
        "MegatronStrategy(pipeline_model_parallel_size > 1); the events land in <log_dir>/pipeline_events "
        "(or PipelineTimeline(dirpath=...))"
    )


# --- reading -------------------------------------------------------------------------------------
@dataclass
class StepTimeline:
    """One recorded training step of one pipeline (one model replica): every stage's events."""

    step: int
    run: float
    """When the fit that recorded it started (rank 0's clock): tells reruns in one directory apart."""
    schedule: str
    pp_size: int
    virtual_pipeline_size: int
    num_microbatches: int
    stages: dict = field(default_factory=dict)
    """``{pp_rank: [PipelineEvent, ...]}`` in execution order."""
    ranks: dict = field(default_factory=dict)
    """``{pp_rank: global rank}``."""


def find_events_dir(run_dir: Path) -> Path:
    """``run_dir/pipeline_events``, ``run_dir`` itself if it is one, or the newest one below ``run_dir``."""
    if not run_dir.is_dir():
        raise TimelineError(
            f"run directory {run_dir} does not exist; pass the directory the run logged into "
            f"(the Trainer's log_dir) or PipelineTimeline's dirpath"
        )
    if run_dir.name == EVENTS_DIR:
        return run_dir
    if (run_dir / EVENTS_DIR).is_dir():
        return run_dir / EVENTS_DIR
    found = sorted(
        (p for p in run_dir.rglob(EVENTS_DIR) if p.is_dir() and any(p.glob("rank*.jsonl"))),
        key=lambda p: max(f.stat().st_mtime for f in p.glob("rank*.jsonl")),
        reverse=True,
    )
    if not found:
        raise TimelineError(f"no pipeline events under {run_dir} (no {EVENTS_DIR}/rank<R>.jsonl); {_how_to_record()}")
    return found[0]


def _in_replica(record: dict) -> bool:
    coords = record.get("coords", {})
    return all(coords.get(dim, 0) == value for dim, value in REPLICA.items())


def load_steps(events_dir: Path) -> dict[tuple[float, int], StepTimeline]:
    """Every recorded step of the drawn pipeline replica, keyed by ``(run, step)``."""
    files = sorted(events_dir.glob("rank*.jsonl"))
    if not files:
        raise TimelineError(f"{events_dir} holds no rank<R>.jsonl files; {_how_to_record()}")
    steps: dict[tuple[float, int], StepTimeline] = {}
    for path in files:
        with open(path) as f:
            for number, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    record = json.loads(line)
                except json.JSONDecodeError as exc:  # e.g. a run killed while writing its last line
                    raise TimelineError(f"{path}:{number} is not JSON ({exc}); delete that line") from exc
                if not _in_replica(record):
                    continue
                key = (record["run"], record["step"])
                timeline = steps.setdefault(
                    key,
                    StepTimeline(
                        step=record["step"],
                        run=record["run"],
                        schedule=record["schedule"],
                        pp_size=record["pp_size"],
                        virtual_pipeline_size=record["virtual_pipeline_size"],
                        num_microbatches=record["num_microbatches"],
                    ),
                )
                pp_rank = record["coords"]["pp"]
                timeline.stages[pp_rank] = [PipelineEvent(**event) for event in record["events"]]
                timeline.ranks[pp_rank] = record["rank"]
    if not steps:
        raise TimelineError(f"{events_dir} has no events of the pipeline with {REPLICA}; {_how_to_record()}")
    return steps


def select_step(steps: Mapping[tuple[float, int], StepTimeline], step: Optional[int] = None) -> StepTimeline:
    """Step ``step`` of the newest run that recorded it; by default the last step of the newest run (the
    first step also pays one-off costs: allocations, the first communication on each link)."""
    if step is None:
        newest = max(run for run, _ in steps)
        timeline = steps[max(key for key in steps if key[0] == newest)]
    else:
        runs = [key for key in steps if key[1] == step]
        if not runs:
            recorded = sorted({s for _, s in steps})
            raise TimelineError(
                f"step {step} was not recorded; recorded steps: {_ranges(recorded)} (choose which "
                f"with PipelineTimeline(steps=...) or every_n_steps=...)"
            )
        timeline = steps[max(runs)]
    missing = sorted(set(range(timeline.pp_size)) - set(timeline.stages))
    if missing:
        raise TimelineError(
            f"step {timeline.step} lacks the events of pipeline stage(s) {missing} (files "
            f"rank<R>.jsonl of those ranks): every rank of the pipeline must write to the same "
            f"directory (a shared filesystem on several machines)"
        )
    return timeline


def _ranges(values: Sequence[int]) -> str:
    if len(values) <= 12:
        return ", ".join(map(str, values))
    return ", ".join(map(str, values[:5])) + ", ..., " + ", ".join(map(str, values[-5:]))


# --- the bubble ----------------------------------------------------------------------------------
@dataclass
class Bubble:
    """The measured bubble of one step."""

    mean: float
    """Mean over the stages of ``1 - busy / span``."""
    per_stage: dict
    """``{pp_rank: 1 - busy / span}``."""
    busy_s: dict
    """``{pp_rank: seconds of forward and backward work}``."""
    span_s: float
    """First forward's start to last backward's end, across the pipeline."""
    start: float
    """The span's start (``time.time()`` seconds)."""


def measured_bubble(stages: Mapping[int, Sequence[PipelineEvent]]) -> Bubble:
    """The bubble of one training step from every stage's events (see the module docstring)."""
    events = [e for stage_events in stages.values() for e in stage_events]
    forwards = [e for e in events if e.kind == "F"]
    backwards = [e for e in events if e.kind in ("B", "W")]
    if not forwards or not backwards:
        raise TimelineError(
            "a training step's events need forwards and backwards (a forward-only step has no 1F1B bubble to measure)"
        )
    start = min(e.start for e in forwards)
    span = max(e.end for e in backwards) - start
    if span <= 0:
        raise TimelineError("the events span no time: their clocks are not comparable")
    busy = {stage: sum(e.end - e.start for e in stage_events) for stage, stage_events in stages.items()}
    per_stage = {stage: 1.0 - b / span for stage, b in sorted(busy.items())}
    return Bubble(sum(per_stage.values()) / len(per_stage), per_stage, busy, span, start)


def theoretical_bubble(schedule: str, pp_size: int, num_microbatches: int, virtual_pipeline_size: int = 1) -> float:
    """The idle fraction of a step with equal stage times and free communication (Narayanan et al. 2021):
    ``(P - 1) / (M + P - 1)`` for 1F1B and GPipe, ``(P - 1) / (V·M + P - 1)`` interleaved; ZB-H1 (Qi et al. 2024,
    forward, input-gradient and weight-gradient passes of equal time) ``(P - 1) / (3M + P - 1)``; ZB-V and DualPipeV
    (two chunks per rank, each pass of a chunk half a stage's) ``(P - 1) / (6M + P - 1)``: only the warm-up's first
    chunk-forwards are left idle."""
    P, M, V = pp_size, num_microbatches, virtual_pipeline_size
    if schedule in ("1f1b", "gpipe"):
        return (P - 1) / (M + P - 1)
    if schedule == "zb1p":
        return (P - 1) / (3 * M + P - 1)
    if schedule in ("zbv", "dualpipev"):
        return (P - 1) / (6 * M + P - 1)
    if schedule == "interleaved_1f1b":
        return (P - 1) / (V * M + P - 1)
    raise ValueError(f"no bubble formula for schedule {schedule!r}")


def theory_formula(schedule: str) -> str:
    if schedule == "zb1p":
        return "(P-1)/(3M+P-1)"
    if schedule in ("zbv", "dualpipev"):
        return "(P-1)/(6M+P-1)"
    return "(P-1)/(V*M+P-1)" if schedule == "interleaved_1f1b" else "(P-1)/(M+P-1)"

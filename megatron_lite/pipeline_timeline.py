"""``megatron-lite pipeline-timeline RUN_DIR [--step N] [--out FILE.png]``: the measured pipeline bubble of a
training step beside the schedule's theory, and a PNG timeline of every microbatch's forward and backward.

Reads what :class:`megatron_lite.callbacks.PipelineTimeline` wrote: ``RUN_DIR/pipeline_events/rank<R>.jsonl``,
one line per recorded step and rank, holding that rank's events (:class:`PipelineEvent`: kind ``F``/``B``,
model chunk, virtual stage, microbatch, wall-clock ``start``/``end`` in ``time.time()`` seconds, ``start``
taken once the input had arrived).

**Measured bubble** of one step: its span runs from the first forward's start to the last backward's end
across the pipeline; a stage's bubble is ``1 - busy / span`` (busy: the sum of its events' durations), and
the step's bubble is the mean over the stages. **Theory** (equal stage times, no communication cost):
1F1B and GPipe ``(P - 1) / (M + P - 1)``, interleaved 1F1B ``(P - 1) / (V·M + P - 1)`` for P stages,
M microbatches and V model chunks per stage.

Every rank's events are in one picture only when the ranks share a clock (one machine, or clocks kept in
sync by NTP to well under a microbatch). With several pipelines (data, tensor or context parallel
replicas), the one of data/tensor/context rank 0 is shown.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from megatron_lite.core.parallel.pipeline.schedules import PipelineEvent
from megatron_lite.utils.console import exits_quietly_on_broken_pipe

EVENTS_DIR = "pipeline_events"
LOGGING_EXTRA = 'pip install "megatron-lite[logging]"'
# The pipeline replica drawn when data/tensor/context parallelism makes several: coordinates other than pp.
REPLICA = {"dp": 0, "tp": 0, "cp": 0, "ep": 0}


class TimelineError(Exception):
    """A problem the user can fix; the message says how."""


def _how_to_record() -> str:
    return ("record them with Trainer(callbacks=[megatron_lite.callbacks.PipelineTimeline()]) under "
            "MegatronStrategy(pipeline_model_parallel_size > 1); the events land in <log_dir>/pipeline_events "
            "(or PipelineTimeline(dirpath=...))")


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
        raise TimelineError(f"run directory {run_dir} does not exist; pass the directory the run logged into "
                            f"(the Trainer's log_dir) or PipelineTimeline's dirpath")
    if run_dir.name == EVENTS_DIR:
        return run_dir
    if (run_dir / EVENTS_DIR).is_dir():
        return run_dir / EVENTS_DIR
    found = sorted((p for p in run_dir.rglob(EVENTS_DIR) if p.is_dir() and any(p.glob("rank*.jsonl"))),
                   key=lambda p: max(f.stat().st_mtime for f in p.glob("rank*.jsonl")), reverse=True)
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
                timeline = steps.setdefault(key, StepTimeline(
                    step=record["step"], run=record["run"], schedule=record["schedule"], pp_size=record["pp_size"],
                    virtual_pipeline_size=record["virtual_pipeline_size"],
                    num_microbatches=record["num_microbatches"]))
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
            raise TimelineError(f"step {step} was not recorded; recorded steps: {_ranges(recorded)} (choose which "
                                f"with PipelineTimeline(steps=...) or every_n_steps=...)")
        timeline = steps[max(runs)]
    missing = sorted(set(range(timeline.pp_size)) - set(timeline.stages))
    if missing:
        raise TimelineError(f"step {timeline.step} lacks the events of pipeline stage(s) {missing} (files "
                            f"rank<R>.jsonl of those ranks): every rank of the pipeline must write to the same "
                            f"directory (a shared filesystem on several machines)")
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
    backwards = [e for e in events if e.kind == "B"]
    if not forwards or not backwards:
        raise TimelineError("a training step's events need forwards and backwards (a forward-only step has no "
                            "1F1B bubble to measure)")
    start = min(e.start for e in forwards)
    span = max(e.end for e in backwards) - start
    if span <= 0:
        raise TimelineError("the events span no time: their clocks are not comparable")
    busy = {stage: sum(e.end - e.start for e in stage_events) for stage, stage_events in stages.items()}
    per_stage = {stage: 1.0 - b / span for stage, b in sorted(busy.items())}
    return Bubble(sum(per_stage.values()) / len(per_stage), per_stage, busy, span, start)


def theoretical_bubble(schedule: str, pp_size: int, num_microbatches: int, virtual_pipeline_size: int = 1) -> float:
    """The idle fraction of a step with equal stage times and free communication (Narayanan et al. 2021):
    ``(P - 1) / (M + P - 1)`` for 1F1B and GPipe, ``(P - 1) / (V·M + P - 1)`` interleaved."""
    P, M, V = pp_size, num_microbatches, virtual_pipeline_size
    if schedule in ("1f1b", "gpipe"):
        return (P - 1) / (M + P - 1)
    if schedule == "interleaved_1f1b":
        return (P - 1) / (V * M + P - 1)
    raise ValueError(f"no bubble formula for schedule {schedule!r}")


def theory_formula(schedule: str) -> str:
    return "(P-1)/(V*M+P-1)" if schedule == "interleaved_1f1b" else "(P-1)/(M+P-1)"


# --- the picture ---------------------------------------------------------------------------------
DPI = 100
_FORWARD_TEXT = "#333333"  # labels on the light forward blocks (on the dark backwards: white)


_AXES_SHARE = 0.8  # of the figure's width that the time axis gets (the rest: stage labels, legend)


def _label_size(label: str, block_px: float) -> Optional[float]:
    """The font size at which ``label`` fits in a block ``block_px`` wide (bold digits take about 0.62 em),
    or None where even a small one would spill over its neighbours."""
    for points in (8.0, 6.0):
        if block_px >= 0.62 * points * DPI / 72 * len(label) + 3:
            return points
    return None


def plot_timeline(timeline: StepTimeline, out: Path, title: Optional[str] = None):
    """Draw one row per pipeline stage, time on the x axis, every forward (light) and backward (dark,
    hatched) as a block coloured by its microbatch and labelled with its index (``microbatch.chunk``
    with virtual stages). Writes ``out``; returns the matplotlib Figure."""
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
        import matplotlib
    except ImportError as exc:
        raise TimelineError(f"drawing the timeline needs matplotlib: {LOGGING_EXTRA}") from exc
    bubble = measured_bubble(timeline.stages)
    P, V, M = timeline.pp_size, timeline.virtual_pipeline_size, timeline.num_microbatches
    blocks = M * V * 2  # per row
    width = min(max(10.0, 4.0 + 0.4 * blocks), 24.0)  # beyond ~60 blocks a row, labels give way to colour
    figure = Figure(figsize=(width, 1.4 + 0.8 * P), layout="constrained")
    FigureCanvasAgg(figure)  # headless: savefig renders with Agg, no pyplot state
    axes = figure.subplots()
    # tab20 comes in pairs (dark, light) of one hue: a microbatch's backward and forward share a hue.
    palette = matplotlib.colormaps["tab20"].colors
    scale = 1e3  # milliseconds
    span_ms = bubble.span_s * scale
    for stage, events in timeline.stages.items():
        y = P - 1 - stage  # stage 0 on top, as pipeline diagrams are drawn
        for e in events:
            x0, w = (e.start - bubble.start) * scale, (e.end - e.start) * scale
            hue = e.microbatch % 10
            forward = e.kind == "F"
            axes.broken_barh([(x0, w)], (y - 0.38, 0.76), facecolors=palette[2 * hue + (1 if forward else 0)],
                             edgecolors="white" if forward else "black", linewidth=0.6,
                             hatch=None if forward else "//")
            label = str(e.microbatch) if V == 1 else f"{e.microbatch}.{e.chunk}"
            size = _label_size(label, w / span_ms * width * DPI * _AXES_SHARE)
            if size:
                axes.text(x0 + w / 2, y, label, ha="center", va="center", fontsize=size,
                          color=_FORWARD_TEXT if forward else "white", fontweight="bold",
                          bbox=None if forward else dict(boxstyle="square,pad=0.1", facecolor=palette[2 * hue],
                                                         edgecolor="none"))
    axes.set_yticks(range(P))
    axes.set_yticklabels([f"stage {s} (rank {timeline.ranks[s]})\nbubble {bubble.per_stage[s]:.1%}"
                          for s in reversed(range(P))])
    axes.set_ylim(-0.6, P - 0.4)
    axes.set_xlim(0, span_ms)
    axes.set_xlabel("time since the step's first forward (ms)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    theory = theoretical_bubble(timeline.schedule, P, M, V)
    vpp = f", V={V}" if V > 1 else ""
    axes.set_title(title or f"step {timeline.step}: {timeline.schedule}, P={P}{vpp}, M={M}; bubble measured "
                            f"{bubble.mean:.1%} (mean over stages), theory {theory_formula(timeline.schedule)} = "
                            f"{theory:.1%}", fontsize="medium")
    label_note = "microbatch" if V == 1 else "microbatch.chunk"
    axes.legend(handles=[Patch(facecolor=palette[1], edgecolor="white", label="forward"),
                         Patch(facecolor=palette[0], edgecolor="black", hatch="//", label="backward")],
                loc="upper left", bbox_to_anchor=(1.0, 1.0), fontsize="small", title=f"labels: {label_note}",
                title_fontsize="small", frameon=False)
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=DPI)
    return figure


# --- the command ---------------------------------------------------------------------------------
def report(timeline: StepTimeline) -> str:
    """The measured bubble, per stage and mean, beside the theory, as printed by the command."""
    bubble = measured_bubble(timeline.stages)
    P, V, M = timeline.pp_size, timeline.virtual_pipeline_size, timeline.num_microbatches
    theory = theoretical_bubble(timeline.schedule, P, M, V)
    vpp = f", V={V}" if V > 1 else ""
    lines = [f"step {timeline.step}: {timeline.schedule}, P={P}{vpp}, M={M}, span {bubble.span_s * 1e3:.1f} ms",
             f"bubble fraction: measured {bubble.mean:.4f} (mean over stages), "
             f"theory {theory_formula(timeline.schedule)} = {theory:.4f}"
             + (f", measured/theory {bubble.mean / theory:.2f}" if theory > 0 else "")]
    for stage in range(P):
        lines.append(f"  stage {stage} (rank {timeline.ranks[stage]}): busy {bubble.busy_s[stage] * 1e3:.1f} ms, "
                     f"bubble {bubble.per_stage[stage]:.4f}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-lite pipeline-timeline",
        description="Measured pipeline bubble of a training step beside the schedule's theory, and a PNG timeline "
                    "of its forwards and backwards (events recorded by megatron_lite.callbacks.PipelineTimeline).")
    parser.add_argument("run_dir", metavar="RUN_DIR", type=Path,
                        help="the run's log_dir (holding pipeline_events/), PipelineTimeline's dirpath, or a parent")
    parser.add_argument("--step", type=int, default=None, help="optimizer step to show (default: the last recorded)")
    parser.add_argument("--out", type=Path, default=None,
                        help="PNG to write (default: pipeline_timeline_step<N>.png beside pipeline_events/)")
    return parser


@exits_quietly_on_broken_pipe
def main(argv: Optional[list] = None) -> int:
    """Entry point of ``megatron-lite pipeline-timeline``; returns the exit status (2: a problem the user can fix)."""
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as exc:  # --help (0) or a usage error (2): argparse printed the message
        return exc.code if isinstance(exc.code, int) else 2
    try:
        events_dir = find_events_dir(args.run_dir)
        timeline = select_step(load_steps(events_dir), args.step)
        print(report(timeline), flush=True)
        out = args.out if args.out is not None else events_dir.parent / f"pipeline_timeline_step{timeline.step}.png"
        plot_timeline(timeline, out)
    except TimelineError as exc:
        print(f"megatron-lite pipeline-timeline: error: {exc}", file=sys.stderr)
        return 2
    print(f"wrote {out} (events from {events_dir})")
    return 0


if __name__ == "__main__":
    sys.exit(main())

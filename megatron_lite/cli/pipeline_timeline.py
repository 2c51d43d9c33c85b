"""``megatron-lite pipeline-timeline RUN_DIR [--step N] [--out FILE.png]``: the measured pipeline bubble of a
training step beside the schedule's theory, and a PNG timeline of every microbatch's forward and backward.

Reads what :class:`megatron_lite.callbacks.PipelineTimeline` wrote (``RUN_DIR/pipeline_events/rank<R>.jsonl``)
with :mod:`megatron_lite.core.parallel.pipeline.timeline`, which also measures the bubble (per stage
``1 - busy / span``, the mean over the stages) and gives the theory: 1F1B and GPipe ``(P - 1) / (M + P - 1)``,
interleaved 1F1B ``(P - 1) / (V·M + P - 1)``. Every rank's events are in one picture only when the ranks share a
clock; with several pipelines (data, tensor or context parallel replicas), the one of data/tensor/context rank 0
is shown.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Optional

from megatron_lite.cli.command import parse_arguments, run_verb
from megatron_lite.core.parallel.pipeline.timeline import (
    StepTimeline,
    TimelineError,
    find_events_dir,
    load_steps,
    measured_bubble,
    select_step,
    theoretical_bubble,
    theory_formula,
)

LOGGING_EXTRA = 'pip install "megatron-lite[logging]"'


# --- the picture ---------------------------------------------------------------------------------
DPI = 100
_FORWARD_TEXT = "#333333"  # labels on the light forward blocks (on the dark backwards: white)
_HATCH = {"F": None, "B": "//", "W": ".."}  # a split backward's weight pass dotted beside its input pass


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
        import matplotlib
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
        from matplotlib.patches import Patch
    except ImportError as exc:
        raise TimelineError(f"drawing the timeline needs matplotlib: {LOGGING_EXTRA}") from exc
    bubble = measured_bubble(timeline.stages)
    P, V, M = timeline.pp_size, timeline.virtual_pipeline_size, timeline.num_microbatches
    split = any(e.kind == "W" for events in timeline.stages.values() for e in events)
    blocks = M * V * (3 if split else 2)  # per row
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
            axes.broken_barh(
                [(x0, w)],
                (y - 0.38, 0.76),
                facecolors=palette[2 * hue + (1 if forward else 0)],
                edgecolors="white" if forward else "black",
                linewidth=0.6,
                hatch=_HATCH[e.kind],
            )
            label = str(e.microbatch) if V == 1 else f"{e.microbatch}.{e.chunk}"
            size = _label_size(label, w / span_ms * width * DPI * _AXES_SHARE)
            if size:
                axes.text(
                    x0 + w / 2,
                    y,
                    label,
                    ha="center",
                    va="center",
                    fontsize=size,
                    color=_FORWARD_TEXT if forward else "white",
                    fontweight="bold",
                    bbox=None
                    if forward
                    else dict(boxstyle="square,pad=0.1", facecolor=palette[2 * hue], edgecolor="none"),
                )
    axes.set_yticks(range(P))
    axes.set_yticklabels(
        [f"stage {s} (rank {timeline.ranks[s]})\nbubble {bubble.per_stage[s]:.1%}" for s in reversed(range(P))]
    )
    axes.set_ylim(-0.6, P - 0.4)
    axes.set_xlim(0, span_ms)
    axes.set_xlabel("time since the step's first forward (ms)")
    axes.grid(axis="x", alpha=0.3)
    axes.set_axisbelow(True)
    theory = theoretical_bubble(timeline.schedule, P, M, V)
    vpp = f", V={V}" if V > 1 else ""
    axes.set_title(
        title
        or f"step {timeline.step}: {timeline.schedule}, P={P}{vpp}, M={M}; bubble measured "
        f"{bubble.mean:.1%} (mean over stages), theory {theory_formula(timeline.schedule)} = "
        f"{theory:.1%}",
        fontsize="medium",
    )
    label_note = "microbatch" if V == 1 else "microbatch.chunk"
    axes.legend(
        handles=[
            Patch(facecolor=palette[1], edgecolor="white", label="forward"),
            Patch(facecolor=palette[0], edgecolor="black", hatch="//", label="input gradient" if split else "backward"),
            *(
                [Patch(facecolor=palette[0], edgecolor="black", hatch=_HATCH["W"], label="weight gradient")]
                if split
                else []
            ),
        ],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize="small",
        title=f"labels: {label_note}",
        title_fontsize="small",
        frameon=False,
    )
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
    lines = [
        f"step {timeline.step}: {timeline.schedule}, P={P}{vpp}, M={M}, span {bubble.span_s * 1e3:.1f} ms",
        f"bubble fraction: measured {bubble.mean:.4f} (mean over stages), "
        f"theory {theory_formula(timeline.schedule)} = {theory:.4f}"
        + (f", measured/theory {bubble.mean / theory:.2f}" if theory > 0 else ""),
    ]
    for stage in range(P):
        lines.append(
            f"  stage {stage} (rank {timeline.ranks[stage]}): busy {bubble.busy_s[stage] * 1e3:.1f} ms, "
            f"bubble {bubble.per_stage[stage]:.4f}"
        )
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-lite pipeline-timeline",
        description="Measured pipeline bubble of a training step beside the schedule's theory, and a PNG timeline "
        "of its forwards and backwards (events recorded by megatron_lite.callbacks.PipelineTimeline).",
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        type=Path,
        help="the run's log_dir (holding pipeline_events/), PipelineTimeline's dirpath, or a parent",
    )
    parser.add_argument("--step", type=int, default=None, help="optimizer step to show (default: the last recorded)")
    parser.add_argument(
        "--out",
        type=Path,
        default=None,
        help="PNG to write (default: pipeline_timeline_step<N>.png beside pipeline_events/)",
    )
    return parser


def main(argv: Optional[list] = None) -> int:
    """Entry point of ``megatron-lite pipeline-timeline``; returns the exit status (2: a problem the user can fix)."""
    args = parse_arguments(build_parser(), argv)
    if isinstance(args, int):  # --help, or a usage error argparse printed
        return args

    def work() -> tuple[Path, Path]:
        events_dir = find_events_dir(args.run_dir)
        timeline = select_step(load_steps(events_dir), args.step)
        print(report(timeline), flush=True)
        out = args.out if args.out is not None else events_dir.parent / f"pipeline_timeline_step{timeline.step}.png"
        plot_timeline(timeline, out)
        return out, events_dir

    return run_verb(
        "megatron-lite pipeline-timeline",
        work,
        lambda written: print(f"wrote {written[0]} (events from {written[1]})"),
        errors=(TimelineError,),
    )

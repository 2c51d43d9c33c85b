"""``megatron-lite plot RUN_DIR [--out FILE.png]``: loss, learning rate and throughput of a run, as a PNG.

Reads what the run's loggers wrote under ``RUN_DIR``: Lightning's ``CSVLogger`` (``metrics.csv``) and
``TensorBoardLogger`` (``events.out.tfevents.*``, read with TensorBoard's ``EventAccumulator``). When
``RUN_DIR`` holds several runs (``version_0``, ``version_1``, ...), the newest log of each kind is
plotted; pass a version directory to choose another. Drawn headless (matplotlib's Agg canvas, no
display and no global pyplot state).
"""

from __future__ import annotations

import argparse
import csv
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from megatron_lite.cli.command import parse_arguments, run_verb
from megatron_lite.utils.optional import MissingDependencyError, require

Series = dict  # step -> value

# (tag, legend label) of the loss panel
LOSS_TAGS = (("train/loss", "train"), ("val/loss", "validation"))
LR_TAG = "train/lr"
THROUGHPUT_TAG = "train/tokens_per_sec"
TFLOPS_TAG = "train/tflops_per_device"
MFU_TAG = "train/mfu"
FIGURE_INCHES = (8, 9)
DPI = 100
PLOTTED_TAGS = tuple(tag for tag, _ in LOSS_TAGS) + (LR_TAG, THROUGHPUT_TAG)


class PlotError(Exception):
    """A problem the user can fix; the message says how."""


@dataclass
class RunMetrics:
    """Scalar series of one run, merged from its CSV and TensorBoard logs."""

    series: dict = field(default_factory=dict)
    """``{tag: {step: value}}``."""
    sources: list = field(default_factory=list)
    """The files or directories read."""
    ignored: list = field(default_factory=list)
    """Older logs under the run directory that were not read."""

    def add(self, tag: str, step: int, value: float) -> None:
        """Record one value (a later source overwrites the same tag and step: they hold the same number)."""
        self.series.setdefault(tag, {})[int(step)] = float(value)


def _newest_first(paths) -> list:
    return sorted(paths, key=lambda p: p.stat().st_mtime, reverse=True)


def read_csv_metrics(path: Path, into: RunMetrics) -> None:
    """Lightning's ``metrics.csv``: a ``step`` column and one column per metric, blank where not logged."""
    with open(path, newline="") as f:
        for row in csv.DictReader(f):
            step = row.get("step")
            if step in (None, ""):
                continue
            for tag, text in row.items():
                if tag in ("step", "epoch") or text in (None, ""):
                    continue
                try:
                    into.add(tag, int(float(step)), float(text))
                except ValueError:
                    continue  # a non-numeric column (none today) is not a scalar series


def read_tensorboard_metrics(directory: Path, into: RunMetrics) -> None:
    """Every scalar of the event files in ``directory``."""
    reader = require(
        "tensorboard.backend.event_processing.event_accumulator", f"reading the TensorBoard event files in {directory}"
    )
    accumulator = reader.EventAccumulator(str(directory), size_guidance={"scalars": 0})  # 0: keep every event
    accumulator.Reload()
    for tag in accumulator.Tags().get("scalars", []):
        for event in accumulator.Scalars(tag):
            into.add(tag, event.step, event.value)


def load_run(run_dir: Path) -> RunMetrics:
    """The newest ``metrics.csv`` and the newest TensorBoard log directory under ``run_dir``, merged."""
    if not run_dir.is_dir():
        raise PlotError(
            f"run directory {run_dir} does not exist; pass the directory the run logged into "
            f"(the Trainer's default_root_dir or a logger's save_dir)"
        )
    csv_files = _newest_first(run_dir.rglob("metrics.csv"))
    event_dirs = _newest_first({p.parent for p in run_dir.rglob("events.out.tfevents.*")})
    if not csv_files and not event_dirs:
        raise PlotError(
            f"no metrics.csv or TensorBoard event files under {run_dir}; train with "
            f"Trainer(logger=CSVLogger(...)) or TensorBoardLogger(...) writing there, or pass that "
            f"logger's directory"
        )
    run = RunMetrics()
    if event_dirs:
        read_tensorboard_metrics(event_dirs[0], run)
        run.sources.append(event_dirs[0])
    if csv_files:
        read_csv_metrics(csv_files[0], run)
        run.sources.append(csv_files[0])
    run.ignored = [*event_dirs[1:], *csv_files[1:]]
    if not any(tag in run.series for tag in PLOTTED_TAGS):
        raise PlotError(
            f"none of {', '.join(PLOTTED_TAGS)} in {', '.join(map(str, run.sources))}; train with "
            f"GPTModule (loss, lr) and the MegatronMetrics callback (throughput)"
        )
    return run


def _draw(axes, series: Series, label: str, marker: Optional[str] = None) -> None:
    steps = sorted(series)
    axes.plot(steps, [series[s] for s in steps], label=label, marker=marker)


def _mean(series: Series) -> float:
    return sum(series.values()) / len(series)


def _not_logged(axes, what: str) -> None:
    axes.text(0.5, 0.5, f"{what} not logged", ha="center", va="center", transform=axes.transAxes, color="gray")


def plot_run(run: RunMetrics, out: Path, title: str):
    """Three panels over the optimizer step: loss (train and validation), learning rate, throughput.
    Writes ``out`` and returns the matplotlib Figure."""
    Figure = require("matplotlib.figure", "megatron-lite plot").Figure
    FigureCanvasAgg = require("matplotlib.backends.backend_agg", "megatron-lite plot").FigureCanvasAgg
    figure = Figure(figsize=FIGURE_INCHES, layout="constrained")
    FigureCanvasAgg(figure)  # attaches the headless canvas that savefig renders with
    loss_axes, lr_axes, speed_axes = figure.subplots(3, 1, sharex=True)
    figure.suptitle(title)

    loss_axes.set_ylabel("loss")
    drawn = [(tag, label) for tag, label in LOSS_TAGS if run.series.get(tag)]
    for tag, label in drawn:
        _draw(loss_axes, run.series[tag], label, marker="o" if tag.startswith("val/") else None)
    if drawn:
        loss_axes.legend()
    else:
        _not_logged(loss_axes, "loss")

    lr_axes.set_ylabel("learning rate")
    if run.series.get(LR_TAG):
        _draw(lr_axes, run.series[LR_TAG], "lr")
        lr_axes.ticklabel_format(axis="y", style="sci", scilimits=(-3, 3))
    else:
        _not_logged(lr_axes, "learning rate")

    speed_axes.set_ylabel("tokens / s")
    speed_axes.set_xlabel("optimizer step")
    speed_axes.xaxis.get_major_locator().set_params(integer=True)
    if run.series.get(THROUGHPUT_TAG):
        _draw(speed_axes, run.series[THROUGHPUT_TAG], "tokens/s")
        # TFLOP/s and MFU are tokens/s times constants: a second curve would add nothing but a summary does.
        summary = [
            f"mean {_mean(run.series[tag]):{fmt}} {unit}"
            for tag, fmt, unit in ((TFLOPS_TAG, ".3g", "TFLOP/s/device"), (MFU_TAG, ".2%", "MFU"))
            if run.series.get(tag)
        ]
        speed_axes.set_title("throughput" + (f" ({', '.join(summary)})" if summary else ""), fontsize="medium")
    else:
        _not_logged(speed_axes, "throughput")
    out.parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(out, dpi=DPI)
    return figure


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="megatron-lite plot",
        description="Plot loss (train and validation), learning rate and throughput of a run from its "
        "CSVLogger / TensorBoardLogger files.",
    )
    parser.add_argument(
        "run_dir",
        metavar="RUN_DIR",
        type=Path,
        help="directory the run logged into (default_root_dir, a logger's save_dir or a version dir)",
    )
    parser.add_argument("--out", type=Path, default=None, help="PNG to write (default: RUN_DIR/metrics.png)")
    return parser


def main(argv: Optional[list] = None) -> int:
    """Entry point of ``megatron-lite plot``; returns the exit status (2 for a problem the user can fix)."""
    args = parse_arguments(build_parser(), argv)
    if isinstance(args, int):  # --help, or a usage error argparse printed
        return args
    out = args.out if args.out is not None else args.run_dir / "metrics.png"

    def work() -> RunMetrics:
        run = load_run(args.run_dir)
        plot_run(run, out, title=str(args.run_dir))
        return run

    def show(run: RunMetrics) -> None:
        steps = {step for series in run.series.values() for step in series}
        last = max(steps) if steps else math.nan
        print(f"wrote {out} (steps up to {last}, from {', '.join(map(str, run.sources))})")
        if run.ignored:
            print(
                f"note: {len(run.ignored)} older log(s) under {args.run_dir} not plotted "
                f"(pass a version directory to plot one): {', '.join(map(str, run.ignored))}"
            )

    return run_verb("megatron-lite plot", work, show, errors=(PlotError, MissingDependencyError))

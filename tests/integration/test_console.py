"""The console of a training run reads well: Megatron's iteration line, its timer block and our
warnings never split a line of Lightning's progress bar, and the timer block comes at its quieter
interval.

A script trains with the demo's strategy (TP2 over 2 processes) and Lightning's TQDM bar, its
stdout and stderr going into one pipe, as a terminal shows them. The captured bytes are checked
raw (no carriage-return segment of the stream holds both a bar and our text) and as a terminal
would draw them (every line of ours whole, and the bar drawn again below the last one).
"""

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
from lightning.pytorch.callbacks import RichProgressBar, TQDMProgressBar

import megatron_lite as ml
from megatron_lite.callbacks import MegatronMetrics
from megatron_lite.data import MockGPTDataModule

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "tests" / "integration" / "console_run.py"
sys.path.insert(0, str(SCRIPT.parent))
from console_run import SEPARATOR  # noqa: E402

BAR = re.compile(r"\d+%\||\d+/\?? ?\[|it/s\]|s/it\]")  # a tqdm bar: "40%|", "3/12 [", "2.1it/s]"
OURS = re.compile(r"iteration +\d+/|time across ranks|\.{3,}: \(|megatron_lite")
ITERATION = re.compile(r"iteration +(\d+)/ +\d+ \| consumed samples: +\d+ \|.* \| skipped iterations: 0 \|")
TIMER_HEADER = "(min, max) time across ranks (ms):"
TIMER_LINE = re.compile(r" {4}[\w-]+ \.+: \((\d+\.\d\d), (\d+\.\d\d)\)")


def _run_script(tmp_path: Path, settings) -> str:
    env = dict(
        os.environ,
        OMP_NUM_THREADS="1",
        PYTHONUNBUFFERED="1",
        PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    )
    env.pop("MASTER_PORT", None)  # let the launcher pick a free port
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), json.dumps(settings)],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        timeout=300,
    )
    console = proc.stdout.decode("utf-8", errors="replace")
    assert proc.returncode == 0, console[-4000:]
    return console


def render(stream: str) -> list:
    """The lines a terminal of unlimited width shows after ``stream``: ``\\r`` goes back to column 0 and
    overwrites, ``\\n`` starts the next line, ``ESC[nA`` moves up n lines (tqdm's nested bars)."""
    screen: list = [[]]
    row = col = 0
    for token in re.split(r"(\x1b\[\d*A|\r|\n)", stream):
        if token == "\r":
            col = 0
        elif token == "\n":
            row, col = row + 1, 0
        elif token.startswith("\x1b["):
            row = max(0, row - int(token[2:-1] or 1))
        elif token:
            while len(screen) <= row:
                screen.append([])
            line = screen[row]
            line.extend(" " * (col + len(token) - len(line)))
            line[col : col + len(token)] = token
            col += len(token)
    return ["".join(line).rstrip() for line in screen]


def check_console(console: str, max_steps: int) -> tuple:
    """Assert that no line of ours touches a bar line; return (iteration steps, timer blocks), each
    block a list of (name line, min, max)."""
    for segment in re.split(r"[\r\n]", console):
        assert not (BAR.search(segment) and OURS.search(segment)), f"a bar line and our text in one line: {segment!r}"
    lines = render(console)
    for line in lines:
        assert not (BAR.search(line) and OURS.search(line)), f"a bar line and our text in one line: {line!r}"
    iterations, blocks = [], []
    for i, line in enumerate(lines):
        if "iteration " in line:
            match = ITERATION.fullmatch(line)
            assert match, f"a broken iteration line: {line!r}"
            iterations.append((int(match.group(1)), i))
        if "time across ranks" in line:
            assert line == TIMER_HEADER, f"a broken timer header: {line!r}"
            block = []
            for timer_line in lines[i + 1 :]:
                match = TIMER_LINE.fullmatch(timer_line)
                if not match:
                    break
                block.append((timer_line.split()[0], float(match.group(1)), float(match.group(2))))
            assert block, f"a timer header without timers: {lines[i : i + 3]!r}"
            blocks.append((block, i))
        if "megatron_lite" in line and "Warning" in line:
            assert line.startswith("/") or line.startswith("megatron_lite"), f"a warning not at a line start: {line!r}"
    # The bar was drawn again below the last line we printed, and finished.
    final_bar = [i for i, line in enumerate(lines) if re.match(rf"Epoch 0: 100%\|.*\| {max_steps}/{max_steps} ", line)]
    assert final_bar and final_bar[-1] > iterations[-1][1], "the bar is not drawn below the last iteration line"
    return iterations, blocks


def test_demo_strategy_console_with_the_default_metrics(tmp_path):
    """The demo's launcher (each rank re-runs the script) and the callback the strategy adds: an
    iteration line every log step, one timer block per 10 log steps, nothing inside a bar line."""
    console = _run_script(tmp_path, dict(start_method="popen", max_steps=12, log_every_n_steps=1, metrics=None))
    iterations, blocks = check_console(console, max_steps=12)
    assert [step for step, _ in iterations] == list(range(1, 13))
    assert len(blocks) == 1  # at step 10 (10 x log_every_n_steps), not at every log step
    block, at = blocks[0]
    assert [step for step, i in iterations if i < at][-1] == 10  # printed right after iteration 10's line
    names = [name for name, _, _ in block]
    assert {"forward-backward", "optimizer"} <= set(names)


# The fork launcher's runs (as in a notebook): one script process trains them one after the other, and the
# tests below read each one's console (one interpreter start instead of three; the tests share a worker).
FORK_RUNS = {
    "chosen_intervals": dict(
        start_method="fork", max_steps=12, log_every_n_steps=1, metrics=dict(log_interval=2, timers_interval=4)
    ),
    "timers_off": dict(start_method="fork", max_steps=4, log_every_n_steps=1, metrics=dict(timers_interval=0)),
    "console_off": dict(start_method="fork", max_steps=4, log_every_n_steps=1, metrics=dict(console=False)),
}


@pytest.fixture(scope="module")
def fork_consoles(tmp_path_factory) -> dict:
    console = _run_script(tmp_path_factory.mktemp("fork"), list(FORK_RUNS.values()))
    consoles = console.split(SEPARATOR + "\n")
    assert len(consoles) == len(FORK_RUNS), console[-4000:]
    return dict(zip(FORK_RUNS, consoles))


@pytest.mark.xdist_group("console_fork")
def test_notebook_launcher_console_with_chosen_intervals(fork_consoles):
    """The fork launcher (notebooks) with MegatronMetrics(log_interval=2, timers_interval=4): a line every
    2 steps, a block every 4, each block the per-step times over its 4 steps."""
    console = fork_consoles["chosen_intervals"]
    iterations, blocks = check_console(console, max_steps=12)
    assert [step for step, _ in iterations] == [2, 4, 6, 8, 10, 12]
    assert [[step for step, i in iterations if i < at][-1] for _, at in blocks] == [4, 8, 12]
    for block, _ in blocks:
        assert all(0.0 <= low <= high for _, low, high in block)
        assert dict((name, high) for name, _, high in block)["forward-backward"] > 0.0


@pytest.mark.xdist_group("console_fork")
def test_timer_block_off_and_console_off(fork_consoles):
    iterations, blocks = check_console(fork_consoles["timers_off"], max_steps=4)
    assert len(iterations) == 4 and blocks == []
    console = fork_consoles["console_off"]
    assert "iteration " not in console and TIMER_HEADER not in console


def _tiny_fit(callbacks, **trainer_kwargs):
    trainer = L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=3,
        log_every_n_steps=1,
        limit_val_batches=0,
        logger=False,
        enable_checkpointing=False,
        enable_model_summary=False,
        callbacks=callbacks,
        **trainer_kwargs,
    )
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    trainer.fit(
        ml.GPTModule(config), MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=2, vocab_size=256)
    )


def test_rich_bar_of_a_max_steps_run_has_no_negative_epoch_total():
    """max_steps without max_epochs makes Lightning set max_epochs=-1, and its Rich bar (the default bar whenever
    rich is installed) then read "Epoch 0/-2"; the metrics callback titles it "Epoch 0". The callbacks come in
    the order MegatronStrategy gives them: the Trainer's bar, then the MegatronMetrics the strategy adds."""
    screen = io.StringIO()
    bar = RichProgressBar(leave=True, console_kwargs=dict(file=screen, force_terminal=True, width=200))
    titles = []

    class Titles(L.Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            titles.append(bar.progress.tasks[bar.train_progress_bar_id].description)

    _tiny_fit([bar, MegatronMetrics(peak_tflops_per_device=1.0), Titles()])
    assert titles == ["Epoch 0   "] * 3  # from the first step on (as wide as "Validation")
    frames = screen.getvalue().split("\x1b[2K")  # Rich clears the line before each frame
    assert re.match(r"Epoch 0 +\S* *━+", frames[-1]), frames[-1]
    assert bar.progress.tasks[bar.train_progress_bar_id].completed == 3  # the count is the run's steps


@pytest.mark.parametrize("bar", ["disabled_bar", "no_bar"])
def test_iteration_lines_without_a_drawn_bar_are_printed(capsys, bar):
    """A disabled TQDM bar (refresh_rate=0) has no active bar to write through, and its print() drops
    the text: the lines must come through plain print then, as without any bar."""
    metrics = MegatronMetrics(peak_tflops_per_device=1.0)
    if bar == "disabled_bar":
        _tiny_fit([TQDMProgressBar(refresh_rate=0), metrics])
    else:
        _tiny_fit([metrics], enable_progress_bar=False)
    out = capsys.readouterr().out
    assert [int(m) for m in re.findall(r"^iteration +(\d+)/", out, flags=re.M)] == [1, 2, 3]


def test_bad_intervals_name_the_fix():
    with pytest.raises(ValueError, match="log_interval must be a positive number of steps or None"):
        MegatronMetrics(log_interval=0)
    with pytest.raises(ValueError, match=r"timers_interval must be a number of steps >= 0"):
        MegatronMetrics(timers_interval=-1)
    with pytest.raises(
        ValueError,
        match=r"MegatronMetrics\(timers_interval=5\) must be a multiple of the log "
        r"interval \(2\).*set timers_interval=4",
    ):
        _tiny_fit([MegatronMetrics(peak_tflops_per_device=1.0, log_interval=2, timers_interval=5)])

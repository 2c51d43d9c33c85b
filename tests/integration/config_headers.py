"""The ``megatron-lite`` commands written in the header comments of ``examples/configs/*.yaml``, as
test_example_config_commands.py runs them, and which commands shown elsewhere (the docs) are the same ones.

A shown command is the same as a header's when both are equal once the options that test sets itself are dropped
(a fit's ``--trainer.max_steps 200`` never runs there: it runs with 2 steps), so the docs tests can leave it to
that test instead of running the same fit twice.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
CONFIGS = sorted((REPO / "examples" / "configs").glob("*.yaml"))
# what a shortened fit adds to the command as written (later options win), before its --trainer.max_steps
SHORT_FIT = [
    "--trainer.val_check_interval",
    "2",
    "--trainer.limit_val_batches",
    "1",
    "--trainer.log_every_n_steps",
    "1",
    "--model.optimizer.lr_warmup_iters",
    "1",
    "--trainer.strategy.init_args.start_method",
    "fork",
    "--trainer.enable_progress_bar",
    "false",
    "--trainer.callbacks.every_n_train_steps",
    "1",
]
# the options the header test sets on every fit: what a command shows for them never runs there
_SET_BY_THE_TEST = {*SHORT_FIT[::2], "--trainer.max_steps"}


def header_commands(config: Path) -> list[list[str]]:
    """The ``megatron-lite`` commands of the comment lines that open ``config``, as argument lists without the
    program: a line of its own (continued after a trailing backslash, a note in parentheses after it dropped) or
    one with arguments in backticks."""
    header = []
    for line in config.read_text().splitlines():
        if not line.startswith("#"):
            break
        header.append(line[1:].strip())
    text = "\n".join(header).replace("\\\n", " ")
    commands = [re.sub(r"\s{2,}\(.*\)$", "", line) for line in text.splitlines() if line.startswith("megatron-lite ")]
    commands += re.findall(r"`(megatron-lite \S+ [^`]+)`", text)  # with arguments: "`megatron-lite plot`" names it
    return [shlex.split(command)[1:] for command in commands]


def normalised(args: list[str]) -> tuple[str, ...]:
    """A command's arguments (without the program) with the options the header test sets itself dropped."""
    kept, i = [], 0
    while i < len(args):
        option = args[i].split("=", 1)[0]
        if args[0] == "fit" and option in _SET_BY_THE_TEST:
            i += 1 if "=" in args[i] else 2
            continue
        kept.append(args[i])
        i += 1
    return tuple(kept)


def run_by_the_header_test() -> dict[tuple[str, ...], str]:
    """Every command test_example_config_commands.py runs, by its :func:`normalised` arguments, with the config
    whose header shows it."""
    return {normalised(args): config.name for config in CONFIGS for args in header_commands(config)}

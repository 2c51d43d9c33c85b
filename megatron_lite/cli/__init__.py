"""``megatron-lite``: Lightning's CLI (fit / validate / test / predict) with megatron-lite defaults, plus tools.

    megatron-lite fit --config examples/configs/gpt_tiny.yaml --trainer.max_steps 100 \
        --trainer.strategy.init_args.tensor_model_parallel_size 2
    megatron-lite preprocess --input corpus.jsonl.gz --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --workers 4 --append-eod
    megatron-lite estimate --config examples/configs/gpt_tiny.yaml --devices 4 [--json]
    megatron-lite plot runs/lightning_logs/version_0
    megatron-lite checkpoint inspect runs/ckpts/last.ckpt [--json]
    megatron-lite convert --from hf --input llama_dir --output ckpt    (and --to hf --input ckpt --output hf_dir)
    megatron-lite generate --ckpt runs/demo/checkpoints/last.ckpt --prompt "ROMEO:" --temperature 0.8 --top-p 0.9
    megatron-lite quantize --ckpt runs/demo/checkpoints/last.ckpt --config INT8_SMOOTHQUANT_CFG --data shakespeare \
        --output q
    megatron-lite prune --ckpt runs/demo/checkpoints/last.ckpt --data shakespeare --num-layers 2 --output pruned

The dispatch looks at the verb first and imports only that verb's module (``megatron_lite.cli.<verb>``, each with
``main(argv) -> exit code``): the tools that need no Lightning start without importing it, and ``--help`` is
printed here. Everything that is not a tool goes to :mod:`megatron_lite.cli.lightning_cli`.
"""

from __future__ import annotations

import difflib
import importlib
import os
import sys
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Optional

from megatron_lite.cli.command import (
    DEBUG_VARIABLE,
    EXIT_OK,
    closing_quietly_on_broken_pipe,
    our_configuration_error,
    report_user_error,
)

if TYPE_CHECKING:  # imported on first use: they import Lightning
    from megatron_lite.cli.lightning_cli import CommandLineError, MegatronLiteCLI

__all__ = ["TOOLS", "TRAINING", "CommandLineError", "MegatronLiteCLI", "Verb", "help_text", "main"]

PROG = "megatron-lite"


@dataclass(frozen=True)
class Verb:
    """One verb of the command."""

    module: Optional[str]
    """The module whose ``main(argv) -> int`` runs it (None: Lightning's CLI runs it)."""
    summary: str
    """One line for ``megatron-lite --help``."""


TRAINING = {
    "fit": Verb(None, "train (and validate) a model: `megatron-lite fit --config FILE`"),
    "validate": Verb(None, "one evaluation pass over the validation set"),
    "test": Verb(None, "one evaluation pass over the test set"),
    "predict": Verb(None, "run the model's predict_step over the data"),
}
"""LightningCLI's subcommands (:mod:`megatron_lite.cli.lightning_cli`)."""

TOOLS = {
    "preprocess": Verb(
        "megatron_lite.cli.preprocess", "JSONL/parquet/HF datasets -> Megatron .bin/.idx (and `preprocess merge`)"
    ),
    "estimate": Verb("megatron_lite.cli.estimate", "per-rank memory and FLOPs of a `fit` config, before launch"),
    "plot": Verb("megatron_lite.cli.plot", "PNG of a run's loss, learning rate and throughput"),
    "pipeline-timeline": Verb(
        "megatron_lite.cli.pipeline_timeline",
        "measured pipeline bubble of a step beside the theory, and its timeline PNG",
    ),
    "checkpoint": Verb(
        "megatron_lite.cli.checkpoint", "`checkpoint inspect`: what a checkpoint holds, whether its files are intact"
    ),
    "convert": Verb("megatron_lite.cli.convert", "Hugging Face Llama models to our checkpoints and back"),
    "generate": Verb("megatron_lite.cli.generate", "continue prompts with a trained checkpoint"),
    "quantize": Verb("megatron_lite.cli.quantize", "ModelOpt post-training quantization of a checkpoint"),
    "prune": Verb("megatron_lite.cli.prune", "Minitron-style depth/width pruning of a checkpoint"),
}
"""The tools: argparse commands of their own, each imported only when asked for."""


def help_text() -> str:
    """``megatron-lite --help``: every verb in one line."""
    width = max(map(len, (*TRAINING, *TOOLS))) + 2
    lines = [
        f"usage: {PROG} [-h] {{{','.join(TRAINING)}}} ... | {PROG} TOOL ...",
        "",
        "megatron-lite: Megatron-style training on Lightning.",
        "",
        f"training (Lightning's CLI; `{PROG} fit --help` lists every option, `--print_config` the resolved "
        f"configuration):",
    ]
    lines += [f"  {name:<{width}}{verb.summary}" for name, verb in TRAINING.items()]
    lines += ["", "tools:"]
    lines += [f"  {name:<{width}}{verb.summary}" for name, verb in TOOLS.items()]
    lines += [
        "",
        f"`{PROG} VERB --help` shows a verb's options. Set {DEBUG_VARIABLE}=1 to see the traceback of a "
        f"configuration error.",
    ]
    return "\n".join(lines)


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``megatron-lite`` console script and ``python -m megatron_lite``: exits with a tool's exit
    code; returns after a LightningCLI run that went well (as ``LightningCLI`` does)."""
    argv = list(sys.argv[1:] if args is None else args)
    status = closing_quietly_on_broken_pipe(lambda: _dispatch(argv))
    if status is not None:
        sys.exit(status)


def _dispatch(argv: list[str]) -> Optional[int]:
    if not argv:
        return report_user_error(
            PROG, ValueError(f"name a verb: {', '.join((*TRAINING, *TOOLS))}; see `{PROG} --help`")
        )
    if argv[0] in ("-h", "--help"):
        print(help_text())
        return EXIT_OK
    verb = argv[0]
    if verb not in TOOLS and verb not in TRAINING and not verb.startswith("-"):
        close = difflib.get_close_matches(verb, [*TRAINING, *TOOLS], n=1)
        hint = f" (did you mean {close[0]}?)" if close else ""
        return report_user_error(PROG, ValueError(f"unknown verb {verb!r}{hint}; see `{PROG} --help`"))
    try:
        if verb in TOOLS:
            return importlib.import_module(TOOLS[verb].module).main(argv[1:])
        # fit/validate/test/predict, and Lightning's own options before them (--config FILE fit ...)
        from megatron_lite.cli.lightning_cli import run_lightning_cli

        run_lightning_cli(argv)
        return None
    except Exception as exc:  # noqa: BLE001 - our own configuration errors in one line, anything else re-raised
        error = None if os.environ.get(DEBUG_VARIABLE) else our_configuration_error(exc)
        if error is None:
            raise
        return report_user_error(PROG, error)


def __getattr__(name: str) -> Any:
    """``megatron_lite.cli.MegatronLiteCLI`` / ``CommandLineError`` without importing Lightning up front."""
    if name in ("MegatronLiteCLI", "CommandLineError"):
        return getattr(importlib.import_module("megatron_lite.cli.lightning_cli"), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")

"""``megatron-lite``: Lightning's CLI (fit / validate / test / predict) with megatron-lite defaults,
plus the tools ``preprocess`` (JSONL/parquet/HF datasets -> Megatron .bin/.idx, and ``merge``),
``estimate`` (memory and FLOPs of a config, before launch), ``plot`` (PNG of a run's curves),
``checkpoint inspect`` (what a checkpoint holds, whether its files are intact), ``convert``
(Hugging Face Llama models to our checkpoints and back; a quantized checkpoint to ModelOpt's unified HF
format), ``generate`` (continue prompts with a trained checkpoint, optionally with a speculative draft head),
``quantize`` (ModelOpt PTQ of a checkpoint) and ``prune`` (Minitron-style depth/width pruning of a checkpoint).

    megatron-lite fit --config examples/configs/gpt_tiny.yaml --trainer.max_steps 100 \
        --trainer.strategy.init_args.tensor_model_parallel_size 2
    megatron-lite preprocess --input corpus.jsonl.gz --output-prefix data/corpus \
        --tokenizer-type GPT2BPETokenizer --vocab-file vocab.json --merge-file merges.txt --workers 4 --append-eod
    megatron-lite estimate --config examples/configs/gpt_tiny.yaml --devices 4 [--json]
    megatron-lite plot runs/lightning_logs/version_0
    megatron-lite checkpoint inspect runs/ckpts/last.ckpt [--json]
    megatron-lite convert --from hf --input llama_dir --output ckpt    (and --to hf --input ckpt --output hf_dir)
    megatron-lite generate --ckpt runs/demo/checkpoints/last.ckpt --prompt "ROMEO:" --temperature 0.8 --top-p 0.9
    megatron-lite quantize --ckpt runs/demo/checkpoints/last.ckpt --config INT8_SMOOTHQUANT_CFG --data shakespeare --output q
    megatron-lite prune --ckpt runs/demo/checkpoints/last.ckpt --data shakespeare --num-layers 2 --output pruned

Every strategy, model and data option can be overridden on the command line; ``--print_config``
shows the full resolved configuration.
"""
from __future__ import annotations

import importlib
import os
import sys
import traceback
from argparse import ArgumentError
from pathlib import Path
from typing import Optional

from lightning.pytorch.cli import LightningCLI
from lightning_utilities.core.imports import RequirementCache

import megatron_lite  # noqa: F401  (registers the "megatron" strategy)
from megatron_lite.cli_errors import explain_parse_error
from megatron_lite.data import PretrainingDataModule
from megatron_lite.module import GPTModule
from megatron_lite.utils.optional import MissingDependencyError, missing_dependency

# What LightningCLI checks before it builds its parser (a base dependency; absent after `pip install --no-deps`)
_JSONARGPARSE = "jsonargparse[signatures]>=4.27.7"


class MegatronLiteCLI(LightningCLI):
    """LightningCLI whose model is :class:`GPTModule` or any subclass of it (``model.class_path:
    megatron_lite.rl.DPOModule``, ``RewardModelModule``, your own) and whose data is any pretraining
    datamodule (``PreferenceDataModule``, ``SFTDataModule``, ...).

    Both are in jsonargparse's subclass mode; a ``model:`` section without ``class_path`` still means
    GPTModule (jsonargparse takes a concrete base class as the implicit class), so ``model.config.*`` keeps
    working on the command line and in every existing YAML."""

    def __init__(self, *args, **kwargs) -> None:
        self._subcommand_parsers_seen: list = []
        """Each subcommand's parser (LightningCLI builds them in its constructor), for the options a misspelled
        one may have meant."""
        super().__init__(*args, **kwargs)

    def add_arguments_to_parser(self, parser) -> None:
        # The data side owns the sequence length and the vocabulary (a trained tokenizer decides it). In subclass
        # mode the model's arguments live under init_args, whichever GPTModule subclass is chosen.
        model = "model.init_args" if self.subclass_mode_model else "model"  # the CLI's own is in subclass mode
        parser.link_arguments("data.seq_length", f"{model}.config.seq_length", apply_on="instantiate")
        parser.link_arguments("data.vocab_size", f"{model}.config.vocab_size", apply_on="instantiate")
        self._subcommand_parsers_seen.append(parser)

    def parse_arguments(self, parser, args) -> None:
        """Lightning's parsing, with a mistake reported in one line (the option, what is wrong with it, a "did you
        mean") instead of jsonargparse's usage and nested report: the parsers are made with ``exit_on_error=False``
        (see :func:`_run_cli`), so the error comes here."""
        try:
            super().parse_arguments(parser, args)
        except ArgumentError as err:
            given = args if isinstance(args, list) else sys.argv[1:]
            subcommand = next((f" {a}" for a in given if a in self.subcommands()), "")
            line = explain_parse_error(str(err), self._known_options)
            raise CommandLineError(f"{line}; see `megatron-lite{subcommand} --help`") from None

    def _known_options(self) -> list[str]:
        """Every subcommand parser's own keys (``trainer.max_steps``, ``ckpt_path``, ...)."""
        return sorted({key for parser in self._subcommand_parsers_seen for key in parser.get_defaults().keys()})


class CommandLineError(ValueError):
    """A mistake on the command line or in the YAML, found by the parser; the message is one line."""


_PACKAGE_DIR = str(Path(__file__).resolve().parent)
_CONFIG_ERRORS = (ValueError, TypeError, FileNotFoundError, MissingDependencyError)


def _configuration_error(exc: BaseException) -> Optional[BaseException]:
    """The root cause of ``exc`` if it is one of our own validation errors, else None.

    Our checks raise ValueError/TypeError/FileNotFoundError (and MissingDependencyError for an optional
    package a configured class needs) with a message that names the fix; a
    user should see that message, not the stack of jsonargparse and Lightning wrapped around it.
    Anything raised elsewhere is a bug and keeps its traceback.
    """
    chain = [exc]
    while chain[-1].__cause__ is not None:  # explicit `raise ... from` chains only
        chain.append(chain[-1].__cause__)
    root = chain[-1]
    if isinstance(root, _CONFIG_ERRORS) and root.__traceback__ is not None and \
            traceback.extract_tb(root.__traceback__)[-1].filename.startswith(_PACKAGE_DIR):
        return root
    # Our error may only survive as text, inside jsonargparse's report on a Union-typed value.
    return next((e for e in map(_error_in_union_value, chain[:-1]) if e is not None), None)


def _error_in_union_value(error: BaseException) -> Optional[ValueError]:
    """Our own error inside jsonargparse's "Does not validate against any of the Union subtypes", else None.

    A class of ours given where a Union is expected (``Trainer(strategy: str | Strategy)``, so any
    ``MegatronStrategy`` option from YAML) that refuses its arguments is reported by jsonargparse as text,
    one ``  - <message>`` line per subtype it tried (the first subtype's error, not ours, chained as the cause).
    """
    text = str(error)
    if not text.startswith("Does not validate against any of the Union subtypes") or \
            "class_path='megatron_lite." not in text:
        return None
    errors = text.split("\nErrors:\n", 1)[-1].split("\nGiven value type:", 1)[0]
    ours = [line.strip()[2:] for line in errors.splitlines()
            if line.strip().startswith("- ") and not line.strip().startswith("- Expected a ")]
    return ValueError(" ".join(ours)) if ours else None


# Subcommands that are tools rather than LightningCLI runs: name -> (module, function(argv) -> exit code).
_TOOLS = {
    "preprocess": ("megatron_lite.data.preprocess", "main"),
    "estimate": ("megatron_lite.estimate", "main"),
    "plot": ("megatron_lite.plot", "main"),
    "pipeline-timeline": ("megatron_lite.pipeline_timeline", "main"),
    "checkpoint": ("megatron_lite.checkpoint_tool", "main"),
    "convert": ("megatron_lite.convert", "main"),
    "generate": ("megatron_lite.generate", "main"),
    "quantize": ("megatron_lite.quantize", "main"),
    "prune": ("megatron_lite.prune", "main"),
}


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``megatron-lite`` console script and ``python -m megatron_lite``.

    Set ``MEGATRON_LITE_DEBUG=1`` to see full tracebacks of configuration errors.
    """
    argv = list(sys.argv[1:] if args is None else args)
    try:
        if argv and argv[0] in _TOOLS:
            module_name, function = _TOOLS[argv[0]]
            tool = getattr(importlib.import_module(module_name), function)
            sys.exit(tool(argv[1:]))
        _run_cli(args)
    except Exception as exc:  # noqa: BLE001 - filtered below, everything else is re-raised
        error = None if os.environ.get("MEGATRON_LITE_DEBUG") else _configuration_error(exc)
        if error is None:
            raise
        print(f"megatron-lite: error: {error}", file=sys.stderr)
        sys.exit(2)


def _run_cli(args: Optional[list[str]]) -> None:
    if not RequirementCache(_JSONARGPARSE):  # else LightningCLI fails with a traceback, even for --help
        raise missing_dependency(_JSONARGPARSE, "cli", "megatron-lite fit/validate/test/predict")
    MegatronLiteCLI(
        GPTModule,
        PretrainingDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"strategy": "megatron"},
        args=args,
        # exit_on_error=False: a parsing mistake reaches MegatronLiteCLI.parse_arguments as an exception (printed
        # there in one line) instead of jsonargparse printing the whole usage and exiting
        parser_kwargs={"description": "megatron-lite: Megatron-style training on Lightning. Tools: "
                                      "`megatron-lite preprocess|estimate|plot|checkpoint|convert|generate|quantize|prune --help`.",
                       "default_env": False, "exit_on_error": False,
                       **{name: {"exit_on_error": False} for name in MegatronLiteCLI.subcommands()}},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main(sys.argv[1:])

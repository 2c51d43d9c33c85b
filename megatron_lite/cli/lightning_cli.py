"""``megatron-lite fit / validate / test / predict``: Lightning's CLI with megatron-lite defaults.

    megatron-lite fit --config examples/configs/gpt_tiny.yaml --trainer.max_steps 100 \
        --trainer.strategy.init_args.tensor_model_parallel_size 2

The model is :class:`GPTModule` or any subclass, the data any pretraining datamodule, the strategy ``"megatron"``
by default. Every strategy, model and data option can be overridden on the command line; ``--print_config``
shows the full resolved configuration. A mistake on the command line or in the YAML is one line
(:mod:`megatron_lite.cli.parse_errors`).
"""

from __future__ import annotations

import sys
from argparse import ArgumentError

from lightning.pytorch.cli import LightningCLI
from lightning_utilities.core.imports import RequirementCache

from megatron_lite.cli.parse_errors import explain_parse_error

# jsonargparse offers the loaded subclasses of a base class by their short names (`--data MockGPTDataModule`)
from megatron_lite.data import (  # noqa: F401
    MockGPTDataModule,
    PreferenceDataModule,
    PretrainDataModule,
    PretrainingDataModule,
    PromptDataModule,
    RLPromptDataModule,
    SFTDataModule,
    TextCorpusDataModule,
)
from megatron_lite.module import GPTModule
from megatron_lite.strategies import register_megatron_strategy
from megatron_lite.utils.optional import missing_dependency

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
        (see :func:`run_lightning_cli`), so the error comes here."""
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


def run_lightning_cli(args: list[str]) -> None:
    """``megatron-lite fit|validate|test|predict ARGS``: run LightningCLI on ``args``."""
    if not RequirementCache(_JSONARGPARSE):  # else LightningCLI fails with a traceback, even for --help
        raise missing_dependency(_JSONARGPARSE, "cli", "megatron-lite fit/validate/test/predict")
    # `import megatron_lite` skips this in the command's own process (see megatron_lite/__init__.py): the
    # default strategy, and any `strategy: megatron` of a YAML, resolve through Lightning's registry
    register_megatron_strategy()
    MegatronLiteCLI(
        GPTModule,
        PretrainingDataModule,
        subclass_mode_model=True,
        subclass_mode_data=True,
        trainer_defaults={"strategy": "megatron"},
        args=args,
        # exit_on_error=False: a parsing mistake reaches MegatronLiteCLI.parse_arguments as an exception (printed
        # there in one line) instead of jsonargparse printing the whole usage and exiting
        parser_kwargs={
            "description": "megatron-lite: Megatron-style training on Lightning. Tools: "
            "`megatron-lite preprocess|estimate|plot|checkpoint|convert|generate|quantize|prune --help`.",
            "default_env": False,
            "exit_on_error": False,
            **{name: {"exit_on_error": False} for name in MegatronLiteCLI.subcommands()},
        },
        save_config_kwargs={"overwrite": True},
    )

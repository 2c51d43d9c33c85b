"""``megatron-lite``: Lightning's CLI (fit / validate / test / predict) with megatron-lite defaults.

    megatron-lite fit --config examples/configs/gpt_tiny.yaml --trainer.max_steps 100 \
        --trainer.strategy.init_args.tensor_model_parallel_size 2

Every strategy, model and data option can be overridden on the command line; ``--print_config``
shows the full resolved configuration.
"""
from __future__ import annotations

import sys
from typing import Optional

from lightning.pytorch.cli import LightningCLI

import megatron_lite  # noqa: F401  (registers the "megatron" strategy)
from megatron_lite.data import PretrainingDataModule
from megatron_lite.module import GPTModule


class MegatronLiteCLI(LightningCLI):
    """LightningCLI whose model is :class:`GPTModule` and whose data is any pretraining datamodule."""

    def add_arguments_to_parser(self, parser) -> None:
        # The data side owns the sequence length and the vocabulary (a trained tokenizer decides it).
        parser.link_arguments("data.seq_length", "model.config.seq_length", apply_on="instantiate")
        parser.link_arguments("data.vocab_size", "model.config.vocab_size", apply_on="instantiate")


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``megatron-lite`` console script and ``python -m megatron_lite``."""
    MegatronLiteCLI(
        GPTModule,
        PretrainingDataModule,
        subclass_mode_data=True,
        trainer_defaults={"strategy": "megatron"},
        args=args,
        parser_kwargs={"description": "megatron-lite: Megatron-style training on Lightning", "default_env": False},
        save_config_kwargs={"overwrite": True},
    )


if __name__ == "__main__":
    main(sys.argv[1:])

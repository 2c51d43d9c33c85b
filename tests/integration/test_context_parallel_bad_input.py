"""Context-parallel settings that cannot run fail once, in the launching process, before any rank starts,
with a message that names the fix (through ``trainer.fit`` with the fork launcher, and through the CLI)."""

from pathlib import Path

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.cli import main
from megatron_lite.data import MockGPTDataModule
from megatron_lite.rl import RewardModelModule

REPO = Path(__file__).resolve().parents[2]


class OwnLossFn(ml.GPTModule):
    def loss_fn(self, model, microbatch):
        return super().loss_fn(model, microbatch)


def _fit(devices=2, seq=16, data_seq=None, module_cls=ml.GPTModule, heads=4, model=None, **strategy):
    config = ml.GPTConfig(
        num_layers=1, hidden_size=32, num_attention_heads=heads, vocab_size=256, seq_length=seq, **(model or {})
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
    )
    data = MockGPTDataModule(seq_length=data_seq or seq, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    trainer.fit(module_cls(config, ml.OptimizerConfig()), data)


@pytest.mark.parametrize(
    "kwargs, fix",
    [
        (
            dict(seq=18, context_parallel_size=2),
            r"GPTConfig.seq_length \(18\) must be divisible by 2 x context_parallel_size = 4 .*set seq_length to a "
            r"multiple of 4 \(e.g. 16\)",
        ),
        (
            dict(seq=32, data_seq=30, context_parallel_size=2),
            r"the data's seq_length \(30\) must be divisible by 2 x context_parallel_size = 4",
        ),
        (
            dict(devices=8, seq=20, context_parallel_size=2, tensor_model_parallel_size=4, sequence_parallel=True),
            r"leaves 10 tokens per rank, which sequence_parallel=True cannot split over "
            r"tensor_model_parallel_size \(4\); "
            r"set seq_length to a multiple of 2 x context_parallel_size x tensor_model_parallel_size = 16",
        ),
        (
            dict(context_parallel_size=2, model=dict(attention_dropout=0.1)),
            r"attention_dropout=0.1 with context_parallel_size=2.*set GPTConfig\(attention_dropout=0.0\)",
        ),
        (
            dict(devices=4, context_parallel_size=2, use_torch_fsdp2=True),
            r"use_torch_fsdp2=True with context_parallel_size=2 is not composed yet.*use_distributed_optimizer=True",
        ),
        (
            dict(context_parallel_size=2, module_cls=OwnLossFn),
            r"OwnLossFn overrides loss_fn.*override forward_step\(part, microbatch, input_tensor\) and loss",
        ),
        (
            dict(devices=2, context_parallel_size=2, tensor_model_parallel_size=2),
            r"world size \(2 processes\) must be divisible by the model-parallel size.* = 4",
        ),
    ],
)
def test_context_parallel_bad_input_names_the_fix(kwargs, fix):
    with pytest.raises(ValueError, match=fix):
        _fit(**kwargs)


def test_unknown_cp_comm_type_is_refused_with_the_choices():
    with pytest.raises(ValueError, match=r"cp_comm_type must be one of \('p2p', 'all_gather'\), got 'ring'"):
        ml.MegatronStrategy(context_parallel_size=2, cp_comm_type="ring")


def test_reward_model_refuses_context_parallelism():
    # Refused from the module's own checks, before the data is read: any datamodule shows it.
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", context_parallel_size=2),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    with pytest.raises(
        ValueError,
        match=r"RewardModelModule does not run under context parallelism.*set "
        r"context_parallel_size=1",
    ):
        trainer.fit(RewardModelModule(config), data)


def test_cli_passes_the_strategy_options_and_reports_an_unknown_cp_comm_type(tmp_path, monkeypatch, capsys):
    """YAML/command-line strategy options reach MegatronStrategy; a bad value is one line, no traceback (the CLI's
    entry in this process: the error comes before any launch)."""
    monkeypatch.chdir(tmp_path)
    args = [
        "fit",
        "--config",
        str(REPO / "examples/configs/gpt_tiny.yaml"),
        "--trainer.strategy.init_args.tensor_model_parallel_size",
        "1",
        "--trainer.strategy.init_args.sequence_parallel",
        "false",
        "--trainer.strategy.init_args.context_parallel_size",
        "2",
        "--trainer.strategy.init_args.cp_comm_type",
        "ring",
    ]
    with pytest.raises(SystemExit) as exit_code:
        main(args)
    err = capsys.readouterr().err
    assert exit_code.value.code != 0
    assert "cp_comm_type must be one of ('p2p', 'all_gather'), got 'ring'" in err
    assert "Traceback" not in err

"""LoRA the way users reach it besides Python (issue 24): ``megatron-lite fit --trainer.callbacks+=
megatron_lite.callbacks.LoRA --trainer.callbacks.dim 4`` fine-tunes only adapters through the CLI at TP2 (its
checkpoint loads back as the adapted model); and every bad input is refused before any rank starts, in one line
naming the fix: an unknown target name (listing the valid ones), a non-positive rank, a target that is not a linear
layer, a pattern matching no layer."""

from __future__ import annotations

import re
import sys
from pathlib import Path

import lightning as L
import pytest

import megatron_lite as ml
from megatron_lite.callbacks import LoRA
from megatron_lite.cli import main
from megatron_lite.core.peft import adapters
from megatron_lite.data import MockGPTDataModule

YAML = """
trainer:
  accelerator: cpu
  devices: 2
  max_steps: 2
  enable_progress_bar: false
  enable_model_summary: false
  num_sanity_val_steps: 0
  limit_val_batches: 0
  logger: false
  default_root_dir: {root}
  strategy:
    class_path: megatron_lite.MegatronStrategy
    init_args: {{tensor_model_parallel_size: 2, start_method: fork}}
  callbacks:
    - class_path: lightning.pytorch.callbacks.ModelCheckpoint
      init_args: {{dirpath: {dirpath}, save_last: true}}
model:
  config: {{num_layers: 2, hidden_size: 32, num_attention_heads: 4, ffn_hidden_size: 64}}
  optimizer: {{lr: 5.0e-2, lr_warmup_iters: 0}}
data:
  class_path: megatron_lite.data.MockGPTDataModule
  init_args: {{seq_length: 16, vocab_size: 128, micro_batch_size: 2, global_batch_size: 4}}
"""


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["megatron-lite"])  # LightningCLI warns when it also sees pytest's arguments


def test_the_cli_fine_tunes_adapters_only(tmp_path: Path) -> None:
    config = tmp_path / "run.yaml"
    config.write_text(YAML.format(dirpath=tmp_path / "ckpt", root=tmp_path))  # the CLI writes its config.yaml there
    main(
        [
            "fit",
            "--config",
            str(config),
            "--trainer.callbacks+=megatron_lite.callbacks.LoRA",
            "--trainer.callbacks.dim",
            "4",
            "--trainer.callbacks.alpha",
            "8",
            "--trainer.callbacks.target_modules",
            "[linear_qkv, linear_fc2]",
        ]
    )
    module = ml.GPTModule.from_pretrained(str(tmp_path / "ckpt" / "last.ckpt"))
    adapted = dict(adapters(module.model))
    assert sorted(adapted) == [
        "layers.0.mlp.linear_fc2",
        "layers.0.self_attention.linear_qkv",
        "layers.1.mlp.linear_fc2",
        "layers.1.self_attention.linear_qkv",
    ]
    for name, adapter in adapted.items():
        assert adapter.linear_in.weight.shape[0] == 4 and adapter.scale == 2.0
        assert adapter.linear_out.weight.abs().max() > 0, f"{name} did not train"


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(target_modules=["linear_q"]), "'linear_q' is not a linear layer of this model; the valid names are "),
        (dict(target_modules=["input_layernorm"]), "'input_layernorm' is not a linear layer of this model"),
        (dict(dim=0), "LoRA dim=0 must be a positive integer"),
        (dict(dim=-4), "LoRA dim=-4 must be a positive integer"),
        (dict(alpha=0), "LoRA alpha=0 must be a positive number"),
        (dict(dropout=1.0), "LoRA dropout=1.0 must lie in [0, 1)"),
        (dict(dropout_position="middle"), "dropout_position='middle' must be 'pre' or 'post'"),
        (dict(target_modules=[]), "LoRA target_modules is empty"),
    ],
)
def test_a_bad_lora_option_is_refused_where_it_is_given(kwargs, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        LoRA(**kwargs)


def _fit(callback: LoRA, **strategy) -> None:
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", **strategy),
        accelerator="cpu",
        devices=2,
        max_steps=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[callback],
    )
    data = MockGPTDataModule(seq_length=16, vocab_size=128, micro_batch_size=1, global_batch_size=2)
    config = ml.GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16)
    trainer.fit(ml.GPTModule(config), data)


@pytest.mark.parametrize(
    "callback, strategy, message",
    [
        (
            LoRA(target_modules=["*.layers.7.*.linear_qkv"]),
            {},
            "'*.layers.7.*.linear_qkv' selects none of this model's linear layers",
        ),
        (LoRA(target_modules=["*.input_layernorm"]), {}, "'*.input_layernorm' selects none of this model's linear"),
    ],
    ids=["pattern-beyond-the-layers", "pattern-on-a-norm"],
)
def test_a_lora_run_that_cannot_work_is_refused_before_launch(callback, strategy, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        _fit(callback, **strategy)

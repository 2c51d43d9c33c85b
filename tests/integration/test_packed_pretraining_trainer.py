"""Packed pretraining rows through a real Trainer, configured from a CLI YAML file: with reset_position_ids and
reset_attention_mask the training loss of a step equals the token-weighted loss of running each document of
its rows alone through the same model, token by token."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch

from megatron_lite.cli.lightning_cli import MegatronLiteCLI
from megatron_lite.core.parallel.packing import check_cu_seqlens
from megatron_lite.core.parallel.schedules import gpt_forward_step
from megatron_lite.data import PretrainDataModule, PretrainingDataModule
from megatron_lite.data.indexed_dataset import write_dataset
from megatron_lite.module import GPTModule

SEQ, VOCAB, GBS, MBS, STEPS = 16, 64, 4, 2, 2
EOD = VOCAB - 1  # NullTokenizer's EOD is its last id


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    """60 documents of 1-12 random tokens, each ending with EOD (as `preprocess --append-eod` writes them)."""
    rng = np.random.default_rng(0)
    docs = [[np.append(rng.integers(0, EOD, size=int(rng.integers(0, 12))), EOD)] for _ in range(60)]
    prefix = str(tmp_path_factory.mktemp("packed") / "corpus")
    write_dataset(prefix, docs, dtype=np.uint16)
    return prefix


class PackedVersusAlone(L.Callback):
    """Before each training step, with the weights the step uses: the per-token losses of every document of the
    step's rows run alone, the packed rows' per-token losses, and the token-weighted mean of the alone runs;
    after the step, the loss the Trainer trained on."""

    def __init__(self) -> None:
        self.per_token_diff: list[float] = []
        self.unpacked_diff: list[float] = []
        self.reference: list[float] = []
        self.trained: list[float] = []
        self.documents = 0

    @torch.no_grad()
    def on_train_batch_start(self, trainer: L.Trainer, pl_module: Any, batch: dict, batch_idx: int) -> None:
        model = pl_module.model
        check_cu_seqlens(batch["cu_seqlens"], SEQ + 1)
        packed = gpt_forward_step(model, batch)  # [b, s]: the packed rows, one forward
        unpacked = gpt_forward_step(model, {"tokens": batch["tokens"]})  # the same rows read as one text
        loss_sum, count = 0.0, 0.0
        for row in range(batch["tokens"].shape[0]):
            tokens, cu = batch["tokens"][row], batch["cu_seqlens"][row]
            bounds = cu[cu >= 0].tolist()
            for start, end in zip(bounds, bounds[1:]):
                if start >= SEQ:
                    continue  # a document that starts at the row's last token is only a label
                inputs_end = min(end, SEQ)
                # the document's tokens and the label of its last input (the next document's first token)
                alone = model(tokens[None, start:inputs_end], tokens[None, start + 1 : inputs_end + 1])[0]
                here = packed[row, start:inputs_end]
                self.per_token_diff.append(float((alone - here).abs().max()))
                if start > 0:  # later documents saw earlier ones when the packing was ignored
                    self.unpacked_diff.append(float((unpacked[row, start:inputs_end] - here).abs().max()))
                mask = batch["loss_mask"][row, start:inputs_end]
                loss_sum += float((alone * mask).sum())
                count += float(mask.sum())
                self.documents += 1
        self.reference.append(loss_sum / count)

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: Any, outputs: Any, batch: dict, batch_idx: int) -> None:
        loss = outputs["loss"] if isinstance(outputs, dict) else outputs
        self.trained.append(float(loss))


@pytest.mark.parametrize("position_embedding_type", ["rope", "learned_absolute"])
def test_packed_loss_equals_documents_alone(
    tmp_path: Path, corpus: str, position_embedding_type: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = tmp_path / "packed.yaml"
    config.write_text(f"""
seed_everything: false  # the model and the data have their own seeds; keep the test process unseeded
trainer:
  accelerator: cpu
  devices: 1
  default_root_dir: {tmp_path / "run"}
  max_steps: {STEPS}
  limit_val_batches: 0
  logger: false
  enable_checkpointing: false
  enable_progress_bar: false
  enable_model_summary: false
model:
  config: {{num_layers: 2, hidden_size: 32, num_attention_heads: 4, position_embedding_type: {position_embedding_type}}}
  optimizer: {{lr: 1.0e-2, lr_warmup_iters: 0}}
data:
  class_path: megatron_lite.data.PretrainDataModule
  init_args:
    paths: [{corpus}]
    split: "90,10"
    seq_length: {SEQ}
    micro_batch_size: {MBS}
    global_batch_size: {GBS}
    cache_dir: {tmp_path / "cache"}
    tokenizer: {{class_path: megatron_lite.tokenizers.NullTokenizer, init_args: {{vocab_size: {VOCAB}}}}}
    reset_position_ids: true
    reset_attention_mask: true
    eod_mask_loss: true
""")
    monkeypatch.setattr(sys, "argv", ["megatron-lite"])  # the CLI reads args=, not pytest's command line
    probe = PackedVersusAlone()
    cli = MegatronLiteCLI(
        GPTModule,
        PretrainingDataModule,
        subclass_mode_data=True,
        run=False,
        trainer_defaults={"strategy": "megatron", "callbacks": [probe]},
        args=["--config", str(config)],
    )
    assert isinstance(cli.datamodule, PretrainDataModule) and cli.datamodule.reset_attention_mask
    cli.trainer.fit(cli.model, cli.datamodule)

    assert len(probe.trained) == len(probe.reference) == STEPS and probe.documents >= 2 * STEPS * GBS
    assert max(probe.per_token_diff) < 1e-5  # every document's per-token losses, packed or alone
    assert probe.trained == pytest.approx(probe.reference, rel=1e-5, abs=1e-6)
    # the packing information is what makes the difference (a tiny model attends almost uniformly, so the
    # change is small, but far above fp32 noise)
    assert max(probe.unpacked_diff) > 1e-3

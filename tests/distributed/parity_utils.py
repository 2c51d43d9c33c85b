"""Run a real Trainer under MegatronStrategy (ranks forked from the test) and record what parity
tests compare: the loss of every step and the full (TP-gathered) gradients of the first step."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.core.parallel.tensor_parallel import gather_full
from megatron_lite.data import MockGPTDataModule


def tiny_config(**overrides) -> ml.GPTConfig:
    """A model small enough for 4 ranks on 2 cores, with GQA so group splitting is exercised."""
    base = dict(num_layers=2, hidden_size=64, num_attention_heads=8, num_query_groups=4, vocab_size=1000,
                seq_length=32, make_vocab_size_divisible_by=32)
    base.update(overrides)
    return ml.GPTConfig(**base)


class Recorder(L.Callback):
    """Saves losses per optimizer step and the first step's full gradients from global rank 0."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.losses: list[float] = []
        self.grads: Optional[dict] = None

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is not None:
            return
        group = pl_module.parallel_layout.group("tp")
        self.grads = {}
        for name, p in pl_module.model.named_parameters():
            self.grads[name] = gather_full(p.grad.detach().clone(), getattr(p, "tp_shard", None), group).cpu()

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save({"losses": self.losses, "grads": self.grads, "global_step": trainer.global_step},
                       self.out / "result.pt")


def run(out: Path, *, devices: int = 1, tp: int = 1, sp: bool = False, steps: int = 10, gbs: int = 8,
        mbs: int = 2, config: Optional[ml.GPTConfig] = None, optimizer: Optional[ml.OptimizerConfig] = None,
        ckpt_path: Optional[str] = None, data=None, accelerator: str = "cpu", start_method: str = "fork",
        **trainer_kwargs) -> dict:
    """Train ``steps`` steps and return the recorded results of global rank 0."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = config or tiny_config()
    if data is None:
        data = MockGPTDataModule(seq_length=config.seq_length, micro_batch_size=mbs, global_batch_size=gbs,
                                 vocab_size=config.vocab_size, seed=7)
    optimizer = optimizer or ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4)
    callbacks = [Recorder(out), *trainer_kwargs.pop("callbacks", [])]
    settings = dict(logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                    limit_val_batches=0)
    settings.update(trainer_kwargs)
    if any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks):
        settings["enable_checkpointing"] = True
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=tp, sequence_parallel=sp, start_method=start_method),
        accelerator=accelerator, devices=devices, max_steps=steps, callbacks=callbacks, **settings)
    module = ml.GPTModule(config, optimizer=optimizer, seed=1234)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return torch.load(out / "result.pt", weights_only=False)


def assert_same_training(result: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Per-step losses and the first step's gradients equal the reference (fp32 tolerance)."""
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=0)
    assert result["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(result["grads"][name], grad, rtol=rtol, atol=rtol * scale,
                                   msg=lambda m, name=name: f"gradient of {name}: {m}")

"""Run a real Trainer under MegatronStrategy (ranks forked from the test) and record what parity
tests compare: the loss of every step and the full (TP-gathered) gradients of the first step."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.callbacks import MegatronMetrics
from megatron_lite.core.parallel.fsdp import full_local_tensor
from megatron_lite.core.parallel.tensor_parallel import gather_full
from megatron_lite.data import MockGPTDataModule

# The MFU peak of the MegatronMetrics the strategy adds, given here: without it every rank of every run times
# a matmul for ~60 ms to estimate one (~14% of a 2-rank run's CPU). Parity compares numbers, not throughput;
# the measured peak is tested where MFU is (test_metrics_callback.py).
PEAK_TFLOPS = 1.0
# Metrics an MoE model's layers and an MTP block report each step (the objective's own report entries are compared
# by their tests)
REPORTED = (
    "train/load_balancing_loss",
    "train/seq_load_balancing_loss",
    "train/global_load_balancing_loss",
    "train/z_loss",
    "train/moe/",
    "train/mtp_loss",
)


def tiny_config(**overrides) -> ml.GPTConfig:
    """A model small enough for 4 ranks on 2 cores, with GQA so group splitting is exercised."""
    base = dict(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        vocab_size=1000,
        seq_length=32,
        make_vocab_size_divisible_by=32,
    )
    base.update(overrides)
    return ml.GPTConfig(**base)


def full_tensors(pl_module, which) -> dict:
    """Full (TP-gathered, FSDP-gathered, from every pipeline stage) fp32 copies of ``which(param)`` for
    every parameter. A tied embedding's copies on the first and last stage must be equal."""
    layout = pl_module.parallel_layout
    group = layout.group("tp")
    out = {}
    for name, p in pl_module.model.named_parameters():
        t = which(p)
        if t is None:
            continue
        t = full_local_tensor(t.detach()).clone().float()
        shard = getattr(p, "tp_shard", None)
        t = gather_full(t, shard, layout.group(shard.group) if shard is not None else group)
        if getattr(p, "expert_shard", None) is not None and layout.group("ep") is not None:
            pieces = [torch.empty_like(t) for _ in range(layout.ep_size)]
            torch.distributed.all_gather(pieces, t.contiguous(), group=layout.group("ep"))
            t = torch.cat(pieces)  # the experts of every EP rank, in expert order
        out[name] = t.cpu()
    if layout.pp_size > 1:
        stages = [None] * layout.pp_size
        torch.distributed.all_gather_object(stages, out, group=layout.group("pp"))
        out = {}
        for stage in stages:
            for name, value in stage.items():
                if name in out:
                    torch.testing.assert_close(value, out[name], rtol=0, atol=0, msg=f"copies of {name} differ")
                out.setdefault(name, value)
    return out


class Recorder(L.Callback):
    """Saves losses per optimizer step, the first step's full gradients (where the model holds them:
    the distributed optimizer moves them into its shards) and the final parameters from global rank 0."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.losses: list[float] = []
        self.grads: Optional[dict] = None
        self.grad_norms: list[float] = []
        self.reported: list[dict] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))
        self.grad_norms.append(float(trainer.callback_metrics["train/grad_norm"]))
        # what the objective and the model's layers reported this step (MoE: router losses, expert loads)
        reported = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith(REPORTED)}
        self.reported.append(reported)

    def on_before_optimizer_step(self, trainer, pl_module, optimizer):
        if self.grads is None:
            self.grads = full_tensors(pl_module, lambda p: p.grad)

    def on_train_end(self, trainer, pl_module):
        params = full_tensors(pl_module, lambda p: p)
        mopt = pl_module.megatron_optimizer
        if trainer.global_rank == 0:
            torch.save(
                {
                    "losses": self.losses,
                    "grads": self.grads,
                    "global_step": trainer.global_step,
                    "params": params,
                    "grad_norms": self.grad_norms,
                    "reported": self.reported,
                    "skipped_steps": mopt.skipped_steps,
                    "overlapped_reductions": getattr(mopt, "overlapped_reductions", 0),
                    "loss_scale": mopt.loss_scale,
                    "master_port": int(os.environ["MASTER_PORT"]) if "MASTER_PORT" in os.environ else None,
                },
                self.out / "result.pt",
            )


def run(
    out: Path,
    *,
    devices: int = 1,
    tp: int = 1,
    sp: bool = False,
    pp: int = 1,
    vpp: int = 1,
    steps: int = 10,
    gbs: int = 8,
    mbs: int = 2,
    config: Optional[ml.GPTConfig] = None,
    optimizer: Optional[ml.OptimizerConfig] = None,
    ckpt_path: Optional[str] = None,
    data=None,
    accelerator: str = "cpu",
    start_method: str = "fork",
    strategy_kwargs: Optional[dict] = None,
    module: Optional[ml.GPTModule] = None,
    **trainer_kwargs,
) -> dict:
    """Train ``steps`` steps (of ``module``, default a fresh GPTModule of ``config``) and return the recorded
    results of global rank 0."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    config = config or tiny_config()
    if data is None:
        data = MockGPTDataModule(
            seq_length=config.seq_length,
            micro_batch_size=mbs,
            global_batch_size=gbs,
            vocab_size=config.vocab_size,
            seed=7,
        )
    optimizer = optimizer or ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4)
    callbacks = [Recorder(out), *trainer_kwargs.pop("callbacks", [])]
    if (strategy_kwargs or {}).get("log_metrics", True) and not any(isinstance(c, MegatronMetrics) for c in callbacks):
        callbacks.append(MegatronMetrics(peak_tflops_per_device=PEAK_TFLOPS))  # where the strategy adds its own
    settings = dict(
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
    )
    settings.update(trainer_kwargs)
    if any(isinstance(c, L.pytorch.callbacks.ModelCheckpoint) for c in callbacks):
        settings["enable_checkpointing"] = True
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
            start_method=start_method,
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            **(strategy_kwargs or {}),
        ),
        accelerator=accelerator,
        devices=devices,
        max_steps=steps,
        callbacks=callbacks,
        **settings,
    )
    module = module or ml.GPTModule(config, optimizer=optimizer, seed=1234)
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return torch.load(out / "result.pt", weights_only=False)


def assert_same_params(result: dict, reference: dict, rtol: float = 1e-5) -> None:
    """Final parameters equal the reference's: per tensor, ||a - b|| <= rtol ||b||. (Element-wise
    tolerances do not suit Adam: a near-zero gradient summed in another order flips the sign of
    m/sqrt(v) and moves that element by ~lr, while the tensor as a whole agrees to fp32 precision.)"""
    assert result["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        error = (result["params"][name] - ref).norm() / ref.norm().clamp(min=1e-30)
        assert error <= rtol, f"parameter {name}: relative error {error:.3g} > {rtol}"


def assert_same_training(
    result: dict, reference: dict, rtol: float = 1e-5, grads: bool = True, params: bool = True
) -> None:
    """Per-step losses, the first step's gradients (unless ``grads=False``) and the final parameters
    (unless ``params=False``) equal the reference (fp32 tolerance)."""
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=rtol, atol=0)
    if params:
        assert_same_params(result, reference, rtol)
    if not grads:
        return
    assert result["grads"].keys() == reference["grads"].keys()
    for name, grad in reference["grads"].items():
        scale = grad.abs().max().item()
        torch.testing.assert_close(
            result["grads"][name],
            grad,
            rtol=rtol,
            atol=rtol * scale,
            msg=lambda m, name=name: f"gradient of {name}: {m}",
        )


class _NodeLayout(L.Callback):
    """Global rank 0 writes OUT/layout.json: per global rank, its node and the global ranks of its TP and DP groups."""

    def __init__(self, out: Path):
        self.out = Path(out)

    def on_train_end(self, trainer, pl_module):
        layout = pl_module.parallel_layout
        mine = {
            "node": trainer.node_rank,
            "tp": torch.distributed.get_process_group_ranks(layout.group("tp")),
            "dp": torch.distributed.get_process_group_ranks(layout.group("dp")),
        }
        ranks = [None] * trainer.world_size
        torch.distributed.all_gather_object(ranks, mine)
        if trainer.global_rank == 0:
            (self.out / "layout.json").write_text(json.dumps(ranks))


if __name__ == "__main__":
    # One rank of a run that torchrun (or SLURM) started: python parity_utils.py OUT '{"devices": 2, "tp": 2, ...}'
    # (run's keyword arguments as JSON); OUT gets result.pt and layout.json.
    import sys

    torch.set_num_threads(1)
    run(Path(sys.argv[1]), callbacks=[_NodeLayout(Path(sys.argv[1]))], **json.loads(sys.argv[2]))

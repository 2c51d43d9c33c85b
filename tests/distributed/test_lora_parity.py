"""LoRA through a real Trainer is the same run at any layout: per-step losses, the first step's adapter gradients
and the final adapters equal the one-process run's (rtol 1e-5) at TP2 (A replicated on column-parallel layers, split
on row-parallel ones), TP2 with sequence parallelism (the adapters' small activations gathered and scattered along
the sequence), PP2, CP2, DP2 with the gradient reduction overlapped in small buckets, DP2 with the distributed
optimizer, DP2 under FSDP2 (the frozen base sharded with the adapters) and TP2 with SP and full recomputation (the
adapters rerun in the recomputed forward); the base stays frozen (no gradient, unchanged). On a DeepSeek-style model
(multi-latent attention with query compression, YaRN, grouped sigmoid MoE with a shared expert, a dense first layer)
the default targets adapt every MLA projection -- the replicated down-projections' A and B whole, their gradients
summed over TP under SP as the layer's own weight's -- and every expert, and TP2+SP equals one process."""

import dataclasses
import json
from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config
from test_mla_parity import DEEPSEEK_MOE, MLA

import megatron_lite as ml
from megatron_lite.callbacks import LoRA
from megatron_lite.core.parallel.fsdp import is_dtensor

CONFIG = tiny_config(num_layers=2, seq_length=16, vocab_size=300, activation="swiglu", normalization="RMSNorm")


class _ShardedBy(L.Callback):
    """Writes, from rank 0, which of the trained model's parameters FSDP2 holds as DTensors."""

    def __init__(self, out: Path) -> None:
        self.out = out

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            names = [n for n, p in pl_module.model.named_parameters() if is_dtensor(p)]
            (self.out / "sharded.json").write_text(json.dumps(names))


def _lora_run(out: Path, optimizer=None, config=CONFIG, callbacks=(), **layout) -> dict:
    lora = LoRA(dim=4, alpha=8, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    # a high LR: the adapters (B starts at zero) move far enough in 3 steps for the comparison to mean something
    optimizer = optimizer or ml.OptimizerConfig(lr=2e-2, lr_warmup_iters=0, lr_decay_iters=20, min_lr=1e-3)
    return run(out, config=config, steps=3, gbs=4, mbs=2, optimizer=optimizer, callbacks=[lora, *callbacks], **layout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _lora_run(tmp_path_factory.mktemp("lora_one"))


def test_only_adapters_train_and_the_base_is_frozen(single):
    base = ml.GPTModule(CONFIG, seed=1234)
    base.configure_model()
    trained = {name for name in single["grads"]}
    assert trained == {name for name in single["params"] if ".adapter." in name}
    assert len(trained) == 2 * 4 * CONFIG.num_layers  # A and B of 4 layers per transformer layer
    frozen = 0
    for name, value in base.model.named_parameters():
        trained_value = single["params"][name]
        real = value.detach().narrow(0, 0, trained_value.shape[0])  # the vocabulary padding is not recorded
        torch.testing.assert_close(trained_value, real, rtol=0, atol=0, msg=f"{name} moved")
        frozen += 1
    assert frozen == len(single["params"]) - len(trained)
    for name, value in single["params"].items():
        if name.endswith("linear_out.weight"):
            assert value.abs().max() > 1e-3, f"{name} did not train"
    assert single["losses"][-1] < single["losses"][0]


@pytest.mark.parametrize(
    "layout",
    [
        dict(devices=2, tp=2),
        dict(devices=2, tp=2, sp=True),
        dict(devices=2, pp=2),
        dict(devices=2, strategy_kwargs=dict(context_parallel_size=2)),
        dict(devices=2, strategy_kwargs=dict(overlap_grad_reduce=True, ddp_bucket_size=2000)),
        dict(devices=2, distributed_optimizer=True),
        dict(devices=2, strategy_kwargs=dict(use_torch_fsdp2=True)),
        dict(
            devices=2,
            tp=2,
            sp=True,
            config=dataclasses.replace(
                CONFIG, recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1
            ),
        ),
    ],
    ids=[
        "tp2",
        "tp2-sp",
        "pp2",
        "cp2",
        "dp2-overlapped-buckets",
        "dp2-distributed-optimizer",
        "dp2-fsdp2",
        "tp2-sp-recompute",
    ],
)
def test_lora_equals_one_process(single, tmp_path, layout):
    layout = dict(layout)
    optimizer = None
    distributed = layout.pop("distributed_optimizer", False)
    if distributed:
        optimizer = ml.OptimizerConfig(
            lr=2e-2, lr_warmup_iters=0, lr_decay_iters=20, min_lr=1e-3, use_distributed_optimizer=True
        )
    fsdp = layout.get("strategy_kwargs", {}).get("use_torch_fsdp2", False)
    if fsdp:
        layout["callbacks"] = [_ShardedBy(tmp_path)]
    result = _lora_run(tmp_path, optimizer=optimizer, **layout)
    if fsdp:  # the frozen base and the adapters both sharded over DP
        sharded = json.loads((tmp_path / "sharded.json").read_text())
        assert "layers.0.mlp.linear_fc1.weight" in sharded and "embedding.weight" in sharded
        assert "layers.0.mlp.linear_fc1.adapter.linear_out.weight" in sharded
    if layout.get("strategy_kwargs", {}).get("overlap_grad_reduce"):
        assert result["overlapped_reductions"] > 0  # the adapters' buckets were reduced during the backward
    # the distributed optimizer moves the gradients into its shards: its losses, grad norms and params are compared
    assert_same_training(result, single, grads=not distributed)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(single["grad_norms"]), rtol=1e-5, atol=0
    )


def test_lora_on_mla_and_deepseek_moe_at_tp2_sp_equals_one_process(tmp_path):
    config = tiny_config(**MLA, **DEEPSEEK_MOE, seq_length=16)
    # SGD: Adam would turn the rounding noise of the down-projections' tiny adapter gradients into full steps
    optimizer = ml.OptimizerConfig(optimizer="sgd", lr=0.1, lr_warmup_iters=0, lr_decay_style="constant")

    def lora_run(out: Path, **layout) -> dict:  # LoRA's default targets: every linear layer the model has
        return run(out, config=config, steps=3, gbs=4, mbs=2, optimizer=optimizer, callbacks=[LoRA(dim=4)], **layout)

    single = lora_run(tmp_path / "one")
    attention = ["linear_q_down_proj", "linear_q_up_proj", "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]
    mlps = {0: ["mlp"], 1: ["mlp.experts", "mlp.shared_experts"]}
    adapted = [f"layers.{i}.self_attention.{name}" for i in mlps for name in attention] + [
        f"layers.{i}.{mlp}.{fc}" for i, names in mlps.items() for mlp in names for fc in ("linear_fc1", "linear_fc2")
    ]
    assert set(single["grads"]) == {f"{n}.adapter.{ab}.weight" for n in adapted for ab in ("linear_in", "linear_out")}
    for name in ("layers.1.self_attention.linear_kv_down_proj", "layers.0.self_attention.linear_q_down_proj"):
        assert single["params"][f"{name}.adapter.linear_out.weight"].abs().max() > 1e-5, f"{name} did not train"
    assert_same_training(lora_run(tmp_path / "tp2-sp", devices=2, tp=2, sp=True), single)

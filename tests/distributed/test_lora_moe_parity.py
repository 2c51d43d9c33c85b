"""LoRA on an MoE model (the experts' fc1/fc2 with one adapter per expert, attention and the shared expert) through a
real Trainer is the same run at any expert layout: per-step losses, the first step's adapter gradients, the final
adapters and the gradient norm equal the one-process run's (rtol 1e-5) at EP2 (each rank its experts' adapters), at
TP2 + SP with ETP2 (the experts' adapters split over ETP: fc1's A and fc2's B replicated with gradients partial over
ETP -- what Megatron-Bridge gets wrong), at TP2 + SP with ETP1 (whole experts beside split attention) and at EP2 with
the distributed optimizer; only adapters train."""

from pathlib import Path

import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config
from test_moe_parity import MOE

import megatron_lite as ml
from megatron_lite.callbacks import LoRA

CONFIG = tiny_config(**MOE, activation="swiglu", moe_shared_expert_intermediate_size=32, seq_length=16)
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


def _optimizer(distributed: bool = False) -> ml.OptimizerConfig:
    # A high LR: the adapters (B starts at zero) move far enough in 3 steps for the comparison to mean something.
    # An eps above rounding: Adam's first step is lr * g / (|g| + eps), a full step even for an element whose
    # gradient is rounding noise (an expert's B entry at 1e-5 of the largest), whose sign no sum order fixes.
    return ml.OptimizerConfig(
        lr=2e-2,
        lr_warmup_iters=0,
        lr_decay_iters=20,
        min_lr=1e-3,
        adam_eps=1e-6,
        use_distributed_optimizer=distributed,
    )


def _lora_run(out: Path, distributed: bool = False, **layout) -> dict:
    lora = LoRA(dim=4, alpha=8, target_modules=TARGETS)
    return run(out, config=CONFIG, steps=3, gbs=4, mbs=2, optimizer=_optimizer(distributed), callbacks=[lora], **layout)


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    return _lora_run(tmp_path_factory.mktemp("lora_moe_one"))


def test_every_expert_adapter_trains_and_nothing_else(single):
    trained = set(single["grads"])
    assert trained == {name for name in single["params"] if ".adapter." in name}
    per_layer = ["self_attention.linear_qkv", "self_attention.linear_proj"] + [
        f"mlp.{mlp}.{fc}" for mlp in ("experts", "shared_experts") for fc in ("linear_fc1", "linear_fc2")
    ]
    expected = {
        f"layers.{i}.{layer}.adapter.{ab}.weight"
        for i in range(CONFIG.num_layers)
        for layer in per_layer
        for ab in ("linear_in", "linear_out")
    }
    assert trained == expected
    experts, ffn, hidden = CONFIG.num_moe_experts, CONFIG.moe_ffn_hidden_size, CONFIG.hidden_size
    shapes = {
        "experts.linear_fc1.adapter.linear_in.weight": (experts, 4, hidden),
        "experts.linear_fc1.adapter.linear_out.weight": (experts, 2 * ffn, 4),
        "experts.linear_fc2.adapter.linear_in.weight": (experts, 4, ffn),
        "experts.linear_fc2.adapter.linear_out.weight": (experts, hidden, 4),
    }
    for suffix, shape in shapes.items():
        value = single["params"][f"layers.0.mlp.{suffix}"]
        assert value.shape == shape
        if "linear_out" in suffix:  # every expert's B moved away from zero
            assert (value.flatten(1).abs().amax(1) > 1e-3).all(), suffix
    assert single["losses"][-1] < single["losses"][0]


@pytest.mark.parametrize(
    "layout",
    [
        dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
        dict(devices=2, tp=2, sp=True),
        dict(devices=2, tp=2, sp=True, strategy_kwargs=dict(expert_tensor_parallel_size=1)),
        dict(devices=2, strategy_kwargs=dict(expert_tensor_parallel_size=2)),
        dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2), distributed=True),
    ],
    ids=["ep2", "tp2-sp-etp2", "tp2-sp-etp1", "dp2-etp2", "ep2-distributed-optimizer"],
)
def test_lora_on_experts_equals_one_process(single, tmp_path, layout):
    result = _lora_run(tmp_path, **layout)
    # the distributed optimizer moves the gradients into its shards: its losses, grad norms and params are compared
    assert_same_training(result, single, grads=not layout.get("distributed", False))
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(single["grad_norms"]), rtol=1e-5, atol=0
    )

"""The estimator on Mixture-of-Experts models: parameter counts (total and active), FLOPs against Megatron's formula,
and the memory estimate's expert layout (EP x ETP shards, expert-DP optimizer state, balanced-routing activations)."""

from __future__ import annotations

import pytest

from megatron_lite.core.estimator import (
    EstimateLayout,
    estimate_memory,
    forward_flops_breakdown,
    training_flops_per_step,
)
from megatron_lite.core.estimator.report import format_table
from megatron_lite.core.models import GPTConfig

MIXTRAL_8X7B = dict(
    num_layers=32,
    hidden_size=4096,
    num_attention_heads=32,
    num_query_groups=8,
    ffn_hidden_size=14336,
    vocab_size=32000,
    seq_length=4096,
    num_moe_experts=8,
    moe_router_topk=2,
)
TINY_MOE = dict(
    num_layers=4,
    hidden_size=64,
    num_attention_heads=4,
    ffn_hidden_size=96,
    vocab_size=300,
    seq_length=32,
    num_moe_experts=4,
    moe_router_topk=2,
    moe_ffn_hidden_size=48,
)


def _megatron_flops(config: GPTConfig, batch: int) -> float:
    """Megatron-LM's ``num_floating_point_operations`` (megatron/training/training.py, ``transformer_flops``) for a
    SwiGLU GQA model with MoE layers every ``moe_layer_freq``, transcribed term by term."""
    s, h, layers = config.seq_length, config.hidden_size, config.num_layers
    moe_layers = sum(1 for i in range(layers) if i % config.moe_layer_freq == 0)
    dense_layers = layers - moe_layers
    shared = config.moe_shared_expert_intermediate_size or 0
    q = config.kv_channels * config.num_attention_heads
    kv = config.kv_channels * config.num_query_groups
    self_attn_term = 3 * 2 * (h * (q + kv + kv) + q * h) * layers
    core_term = 3 * 2 * q / 2 * 2 * layers
    per_token = (
        3
        * 2
        * h
        * (
            config.ffn_hidden_size * 3 * dense_layers
            + config.moe_ffn_hidden_size * config.moe_router_topk * 3 * moe_layers
            + shared * 3 * moe_layers
        )
        + self_attn_term
        + 3 * 2 * h * config.padded_vocab_size()
    )
    return batch * s * per_token + batch * s * s * core_term


def test_mixtral_parameters_total_and_active():
    """Mixtral-8x7B: 46,702,792,704 parameters (the Hugging Face checkpoint's count) of which a token goes through
    12.9B (Mistral's "12.9B active"): all but the 6 experts per layer it is not routed to."""
    config = GPTConfig(**MIXTRAL_8X7B)
    expert = 3 * 4096 * 14336  # gate, up, down
    assert config.num_parameters() == 46_702_792_704
    assert config.num_active_parameters() == 46_702_792_704 - 32 * 6 * expert
    assert round(config.num_active_parameters() / 1e9, 1) == 12.9
    dense = GPTConfig(**{k: v for k, v in MIXTRAL_8X7B.items() if not k.startswith(("num_moe", "moe_"))})
    assert dense.num_active_parameters() == dense.num_parameters()


@pytest.mark.parametrize(
    "moe", [dict(), dict(moe_layer_freq=2, moe_shared_expert_intermediate_size=2048, moe_ffn_hidden_size=1024)]
)
def test_flops_are_megatrons_plus_the_router_and_six_active_parameters_per_token(moe):
    """Training FLOPs count the active experts as Megatron's formula does (top-k x expert MLP + shared expert per MoE
    layer, dense MLPs elsewhere), plus the router's H -> E GEMM that Megatron leaves out; they are 6 x the active
    matmul parameters per token plus causal attention, whatever the expert layout."""
    config = GPTConfig(**{**MIXTRAL_8X7B, "num_layers": 4, **moe})
    gbs, s, h = 8, config.seq_length, config.hidden_size
    moe_layers = sum(1 for i in range(4) if i % config.moe_layer_freq == 0)
    router = 3 * 2 * h * config.num_moe_experts * moe_layers
    ours = training_flops_per_step(config, gbs)
    assert ours == pytest.approx(_megatron_flops(config, gbs) + gbs * s * router, rel=1e-12)
    matmul_active = config.num_active_parameters() - config.vocab_size * h - (2 * 4 + 1) * h  # no lookup, norms
    attention = 6 * 4 * s * config.num_attention_heads * config.kv_channels
    assert ours == pytest.approx((6 * matmul_active + attention) * gbs * s, rel=1e-12)
    assert forward_flops_breakdown(config).router == 2 * h * config.num_moe_experts * moe_layers


def _layout(**options) -> EstimateLayout:
    return EstimateLayout(micro_batch_size=2, seq_length=32, precision="bf16-true", **options)


def test_distributed_optimizer_shards_experts_over_expert_dp_and_the_rest_over_dp_x_cp():
    """Per rank, ZeRO-1 keeps ``(main 4 + Adam 8) / group`` bytes per parameter: the experts' over expert-DP
    (TP x CP x DP / (ETP x EP)), the rest over DP x CP; the fp32 gradient buffers are whole. Folding EP into DP
    leaves the dense part as it is and divides the experts (weights, gradients) by EP and their state by EDP."""
    config = GPTConfig(**TINY_MOE)
    base = dict(tensor_model_parallel_size=2, sequence_parallel=True, data_parallel_size=2, context_parallel_size=2)
    ep1 = estimate_memory(config, _layout(**base, use_distributed_optimizer=True))
    ep2 = estimate_memory(config, _layout(**base, use_distributed_optimizer=True, expert_model_parallel_size=2))
    for est, edp in ((ep1, 4), (ep2, 2)):  # etp = tp = 2: 8 ranks per stage / (2 x ep)
        assert est.layout.expert_data_parallel_size == edp
        dense = est.params - est.expert_params
        assert dense % 4 == 0 and est.expert_params % edp == 0  # no padding with these sizes
        assert est.optimizer_bytes == (dense // 4 + est.expert_params // edp) * (4 + 8)
        assert est.grads_bytes == est.params * 4 and est.weights_bytes == est.params * 2
    assert ep1.params - ep1.expert_params == ep2.params - ep2.expert_params
    assert ep1.expert_params == 2 * ep2.expert_params
    # per MoE layer: 4 / EP experts of (3 x 64 x 48) / ETP parameters
    assert ep2.expert_params == 4 * (4 // 2) * 3 * 64 * 48 // 2
    table = format_table(ep2)
    assert "experts: 8 ranks per stage = etp 2 x ep 2 x edp 2" in table
    assert f"active per token: {config.num_active_parameters():,}" in table
    assert "balanced routing assumed" in table

"""The estimator on Mixture-of-Experts models: parameter counts (total and active), FLOPs against Megatron's formula,
and the memory estimate's expert layout (EP x ETP shards, expert-DP optimizer state, balanced-routing activations)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from test_estimator import _optimizer_bytes_after_a_step
from torch.utils.flop_counter import FlopCounterMode

from megatron_lite.core.estimator import (
    EstimateLayout,
    estimate_memory,
    forward_flops_breakdown,
    measure_activation_bytes,
    measure_retained_tensors,
    parameter_shapes,
    training_flops_per_step,
)
from megatron_lite.core.estimator.report import format_table
from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.models.moe_config import moe_layer_pattern
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from spawn_utils import run_ranks  # noqa: E402

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


# --- the estimate against real MoE models ---------------------------------------------------------------
MOE_VARIANTS = {
    "swiglu": dict(),
    "shared_gated_every_other_layer": dict(
        moe_layer_freq=[1, 0, 1, 0], moe_shared_expert_intermediate_size=32, moe_shared_expert_gate=True
    ),
    "gelu_biases_aux_loss": dict(
        activation="gelu", add_bias_linear=True, normalization="LayerNorm", moe_aux_loss_coeff=0.01
    ),
}


@pytest.mark.parametrize("variant", list(MOE_VARIANTS))
def test_parameter_shapes_and_counts_are_the_real_moe_models(variant):
    """Names, shapes and order of GPTModel's parameters (router, experts, shared expert and its gate, dense MLPs
    where the layer is not MoE); num_parameters() is their sum, num_active_parameters() that sum less the
    experts a token is not routed to, as the built expert tensors size them."""
    config = GPTConfig(**TINY_MOE, **MOE_VARIANTS[variant])
    model = GPTModel(config)
    params = dict(model.named_parameters())
    assert [(p.name, p.shape) for p in parameter_shapes(config)] == [(n, tuple(p.shape)) for n, p in params.items()]
    assert config.num_parameters() == sum(p.numel() for p in params.values())
    per_expert = sum(p[0].numel() for n, p in params.items() if n.startswith("layers.0.mlp.experts."))
    unrouted = sum(moe_layer_pattern(config)) * (config.num_moe_experts - config.moe_router_topk) * per_expert
    assert config.num_active_parameters() == config.num_parameters() - unrouted


def test_flop_counter_agrees_on_an_moe_forward_and_backward():
    """torch's FLOP counter over one forward and backward of a real MoE model (the experts' GEMMs, the router's,
    the shared expert and its gate): 3 x tokens x the estimate's weight matmuls, i.e. 6 x active parameters."""
    config = GPTConfig(**TINY_MOE, **MOE_VARIANTS["shared_gated_every_other_layer"])
    model = GPTModel(config).train()
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    weights = counts.get("aten.mm", 0) + counts.get("aten.addmm", 0)
    assert weights == 3 * tokens.numel() * forward_flops_breakdown(config, 32, causal=False).matmul_with_weights


MEASURED_LAYOUTS = {  # 4 ranks = TP2 (with SP) x DP2, read again as ETP x EP x expert-DP
    "ep1": dict(),  # ETP = TP: expert-DP is DP
    "ep1_etp1": dict(expert_tensor_parallel_size=1),  # whole experts, 4 copies: expert-DP 4
    "ep2_etp1": dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1),  # half the experts, expert-DP 2
}


@pytest.mark.parametrize("precision, distributed", [("32-true", False), ("bf16-true", True)])
@pytest.mark.parametrize("experts", list(MEASURED_LAYOUTS))
def test_moe_weights_grads_and_optimizer_state_are_what_each_rank_holds(experts, precision, distributed):
    """A real step of the Megatron optimizer on 4 ranks (TP2 x DP2) of an MoE model (shared expert, dense layers
    between): each rank's weights, fp32 gradient buffers and optimizer state (masters, Adam's moments; ZeRO-1's
    shards: the experts' over expert-DP, the rest over DP) are the estimate's bytes exactly."""
    parallel = dict(tensor_model_parallel_size=2, sequence_parallel=True, **MEASURED_LAYOUTS[experts])
    shape = dict(TINY_MOE, **MOE_VARIANTS["shared_gated_every_other_layer"])
    measured = run_ranks(_optimizer_bytes_after_a_step, 4, shape, precision, distributed, parallel)
    config = GPTConfig(**shape)
    est = estimate_memory(
        config,
        EstimateLayout(
            micro_batch_size=2,
            seq_length=32,
            data_parallel_size=2,
            precision=precision,
            use_distributed_optimizer=distributed,
            device_type="cpu",
            **parallel,
        ),
    )
    for rank in measured:
        assert (rank["weights"], rank["grads"], rank["optimizer"]) == (
            est.weights_bytes,
            est.grads_bytes,
            est.optimizer_bytes,
        )


ACTIVATION_VARIANTS = {
    **MOE_VARIANTS,
    "alltoall_sigmoid_z_loss_capacity": dict(
        moe_token_dispatcher_type="alltoall",
        moe_router_score_function="sigmoid",
        moe_z_loss_coeff=1e-3,
        moe_expert_capacity_factor=2.0,  # at most 2 x the even share: nothing of these 64 tokens is dropped
    ),
    # the MoE layers keep only their input (and, not modelled, the CPU RNG state their checkpoint saves: 0.5% here)
    "recompute_moe_and_core_attention": dict(
        recompute_granularity="selective",
        recompute_modules=["core_attn", "moe"],
        moe_layer_freq=2,
        moe_shared_expert_intermediate_size=32,
    ),
}


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
@pytest.mark.parametrize("variant", list(ACTIVATION_VARIANTS))
def test_moe_activation_estimate_matches_the_probe(variant, precision):
    """What one forward of a real MoE model keeps for backward (router scores and indices, the sorted tokens'
    indices and weights, the experts' inputs and intermediates, autocast's per-forward copies of the expert
    weights, the weighted outputs the combine keeps, the shared expert) is the estimate: on one rank the experts
    run all top-k x T rows whatever the routing, so the balanced expectation is exact (up to a few scalars)."""
    config = GPTConfig(**TINY_MOE, **ACTIVATION_VARIANTS[variant])
    model = GPTModel(config).train()
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        measured = measure_activation_bytes(model, lambda: (tokens, tokens))
    layout = EstimateLayout(micro_batch_size=2, seq_length=32, precision=precision, device_type="cpu")
    acts = estimate_memory(config, layout).activations
    recompute = config.recomputes("moe")
    assert (acts.per_moe_layer < acts.per_layer) == recompute and acts.per_moe_layer > 0
    assert acts.held_after_forward == pytest.approx(measured, rel=0.01 if recompute else 0.002)


def _expert_ranks_probe(rank: int, world: int, shape: dict, parallel: dict, precision: str) -> tuple:
    """(held, peak) bytes of one forward of this rank's share of the model (each data-parallel rank its own data)."""
    config = GPTConfig(**shape)
    layout = ParallelLayout.build(ParallelConfig(**parallel))
    model = GPTModel(config, layout).train()
    seed = torch.Generator().manual_seed(layout.dp_rank)
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=seed)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=precision == "bf16-mixed"):
        report = measure_retained_tensors(model, lambda: (tokens, tokens))
    return report.total_bytes, report.peak_bytes


EXPERT_RANKS = {  # 2 ranks: (ParallelConfig options, model options, precision, tolerance of the forward's peak)
    "tp2_sp_ep2_etp1_alltoall": (
        dict(
            tensor_model_parallel_size=2,
            sequence_parallel=True,
            expert_model_parallel_size=2,
            expert_tensor_parallel_size=1,
        ),
        dict(moe_token_dispatcher_type="alltoall", moe_shared_expert_intermediate_size=32),
        "bf16-mixed",
        0.03,
    ),
    # One wide MoE layer and a small vocabulary: the forward peaks while the allgather dispatcher holds the gathered
    # tokens (here 7% of the peak). gloo also stages the gathered tokens and the local ones in buffers of its own,
    # which the estimate leaves out (NCCL gathers in place): 4% more on CPU.
    "dp2_ep2_allgather": (
        dict(expert_model_parallel_size=2),
        dict(num_layers=1, hidden_size=512, vocab_size=64, make_vocab_size_divisible_by=32),
        "32-true",
        0.05,
    ),
}


@pytest.mark.parametrize("name", list(EXPERT_RANKS))
def test_moe_activations_on_expert_parallel_ranks_are_the_balanced_expectation(name):
    """On EP ranks each rank's experts get the tokens routed to them, which depends on the data: the ranks'
    mean is the estimate (the rows of all ranks add up to top-k x T per rank), each rank within 10% of it; the
    forward's peak (the loss, or the dispatcher's tokens) agrees on average."""
    parallel, options, precision, tolerance = EXPERT_RANKS[name]
    shape = {**TINY_MOE, **options}
    measured = run_ranks(_expert_ranks_probe, 2, shape, parallel, precision)
    config = GPTConfig(**shape)
    tp = parallel.get("tensor_model_parallel_size", 1)
    layout = EstimateLayout(
        micro_batch_size=2,
        seq_length=32,
        data_parallel_size=2 // tp,
        precision=precision,
        device_type="cpu",
        **parallel,
    )
    acts = estimate_memory(config, layout).activations
    held = [h for h, _ in measured]
    assert acts.held_after_forward == pytest.approx(sum(held) / 2, rel=0.002)
    assert all(h == pytest.approx(acts.held_after_forward, rel=0.1) for h in held)
    assert acts.peak == pytest.approx(sum(p for _, p in measured) / 2, rel=tolerance)
    dispatcher_decides = acts.peak > acts.held_after_forward + acts.loss_transient
    assert dispatcher_decides == name.endswith("allgather")


def test_estimate_command_reads_the_expert_layout_from_the_yaml(tmp_path, capsys):
    """``megatron-lite estimate`` on the MoE example with the strategy's expert options: the JSON's layout has
    them, parameters are this rank's (EP x ETP shards), FLOPs count the active experts; the table prints the
    expert layout."""
    import json

    import yaml

    from megatron_lite.cli.estimate import main

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/configs/moe_tiny.yaml").read_text())
    raw["trainer"]["strategy"]["init_args"].update(
        tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=1
    )
    raw["trainer"]["devices"] = 4
    path = tmp_path / "moe.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    config = GPTConfig(**raw["model"]["config"], vocab_size=2048, seq_length=128)
    assert out["layout"]["expert_model_parallel_size"] == 2 and out["layout"]["expert_tensor_parallel_size"] == 1
    assert out["model_active_params"] == config.num_active_parameters() < out["model_params"]
    assert out["expert_params"] == config.num_layers * (8 // 2) * 3 * 128 * 128  # 4 of 8 whole experts per layer
    assert out["flops_per_step"] == training_flops_per_step(config, 16, tensor_model_parallel_size=2)
    assert main(["--config", str(path)]) == 0
    assert "experts: 4 ranks per stage = etp 1 x ep 2 x edp 2" in capsys.readouterr().out


def test_start_up_report_prints_the_expert_layout(caplog):
    """The strategy's start-up report (``report_memory_estimate``, before any rank starts) of an EP2 run: the
    expert layout, this rank's experts, and the FLOPs that MegatronMetrics' TFLOP/s and MFU count (active experts)."""
    import logging

    import megatron_lite as ml
    from megatron_lite.callbacks.memory_report import flops_per_step, report_memory_estimate
    from megatron_lite.core.parallel.run_spec import RunSpec
    from megatron_lite.data import MockGPTDataModule

    config = GPTConfig(**TINY_MOE)
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=300)
    run = RunSpec(ParallelConfig(expert_model_parallel_size=2), world_size=2, data=data.geometry)
    module = ml.GPTModule(config)
    # rank_zero_info logs under "lightning.pytorch": listened to there, at INFO, whatever level or propagation an
    # earlier test in this worker process left that logger with (CI once ran this test after one that left none).
    lightning_logger = logging.getLogger("lightning.pytorch")
    lightning_logger.addHandler(caplog.handler)
    try:
        with caplog.at_level(logging.INFO, logger="lightning.pytorch"):
            estimate = report_memory_estimate(module, data, run, torch.device("cpu"))
    finally:
        lightning_logger.removeHandler(caplog.handler)
    assert estimate is not None and estimate.expert_params == 4 * 2 * 3 * 64 * 48  # 2 of 4 experts per layer
    assert "experts: 2 ranks per stage = etp 1 x ep 2 x edp 1" in caplog.text
    assert f"this rank's experts: {estimate.expert_params:,}" in caplog.text
    flops = flops_per_step(module, data, data.geometry, 1)
    assert flops == training_flops_per_step(config, 4) and f"FLOPs per step: {flops:.3e}" in caplog.text

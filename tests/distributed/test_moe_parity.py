"""Mixture-of-Experts through a real Trainer equals the single-process run, per step (losses, the first step's full
gradients, the final parameters, the gradient norm), aux loss on, under every expert layout the issue names."""

import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config

import megatron_lite as ml

MOE = dict(num_moe_experts=4, moe_router_topk=2, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, ffn_hidden_size=64)


def _config(**overrides):
    return tiny_config(**{**MOE, **overrides})


def assert_same_reports(result, reference):
    """The router losses and expert loads the layers report are the single process's, per step."""
    assert reference["reported"][0], "the reference reported no MoE metrics"
    for got, want in zip(result["reported"], reference["reported"]):
        assert got.keys() == want.keys()
        for name, value in want.items():
            assert got[name] == pytest.approx(value, rel=1e-5, abs=1e-7), name


LAYOUTS = {
    "ep2": dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
    "ep2-alltoall": dict(
        devices=2, strategy_kwargs=dict(expert_model_parallel_size=2), moe_token_dispatcher_type="alltoall"
    ),
    "ep4-alltoall": dict(
        devices=4, mbs=1, strategy_kwargs=dict(expert_model_parallel_size=4), moe_token_dispatcher_type="alltoall"
    ),
    "tp2-sp-ep2": dict(devices=4, tp=2, sp=True, strategy_kwargs=dict(expert_model_parallel_size=2)),
    "tp2-sp-etp1": dict(devices=2, tp=2, sp=True, strategy_kwargs=dict(expert_tensor_parallel_size=1)),
    "ep2-pp2": dict(devices=4, pp=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """The single-process runs, per micro-batch size: the auxiliary losses are per micro-batch (Megatron's), so
    the reference must cut the global batch into the same micro-batches."""
    cache = {}

    def reference(mbs):
        if mbs not in cache:
            cache[mbs] = run(tmp_path_factory.mktemp(f"single{mbs}"), devices=1, mbs=mbs, config=_config(), steps=3)
        return cache[mbs]

    return reference


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_moe_layout_matches_single_process(name, references, tmp_path):
    kwargs = dict(LAYOUTS[name])
    dispatcher = kwargs.pop("moe_token_dispatcher_type", "allgather")
    reference = references(kwargs.get("mbs", 2))
    result = run(tmp_path, config=_config(moe_token_dispatcher_type=dispatcher), steps=3, **kwargs)
    assert_same_training(result, reference)
    assert_same_reports(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


VARIANTS = {
    # name: (model overrides, run kwargs)
    "ep2-cp2": ({}, dict(devices=4, strategy_kwargs=dict(expert_model_parallel_size=2, context_parallel_size=2))),
    "ep2-dp2-zero1": (
        {},
        dict(devices=4, mbs=1, strategy_kwargs=dict(expert_model_parallel_size=2), distributed_optimizer=True),
    ),
    "ep2-capacity": (
        dict(moe_expert_capacity_factor=1.0),
        dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
    "ep2-capacity-position-padded": (
        dict(moe_expert_capacity_factor=1.5, moe_token_drop_policy="position", moe_pad_expert_input_to_capacity=True),
        dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
    "ep2-expert-bias": (
        dict(moe_router_score_function="sigmoid", moe_router_enable_expert_bias=True, moe_aux_loss_coeff=0.0),
        dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
    "tp2-sp-ep2-shared-gate-freq": (
        dict(
            moe_shared_expert_intermediate_size=32,
            moe_shared_expert_gate=True,
            moe_layer_freq=[1, 0, 1, 1],
            num_layers=4,
        ),
        dict(devices=4, tp=2, sp=True, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
    "ep2-full-recompute-grouped-gemm": (
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1, moe_grouped_gemm=True),
        dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
    "tp2-sp-ep2-recompute-moe-alltoall": (
        dict(
            recompute_granularity="selective",
            recompute_modules=["core_attn", "moe"],
            moe_token_dispatcher_type="alltoall",
        ),
        dict(devices=4, tp=2, sp=True, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
    "ep2-pp2-vpp2": (
        dict(num_layers=4),
        dict(devices=4, pp=2, vpp=2, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
    # the zero-bubble split on MoE layers: the experts' and router's gradients in B, the dense GEMMs' in W
    "ep2-pp2-zb1p": (
        dict(num_layers=4),
        dict(devices=4, pp=2, strategy_kwargs=dict(expert_model_parallel_size=2, pipeline_schedule="zb1p")),
    ),
}


@pytest.mark.parametrize("name", list(VARIANTS))
def test_moe_variant_matches_single_process(name, tmp_path):
    overrides, kwargs = VARIANTS[name]
    kwargs = dict(kwargs)
    zero1 = kwargs.pop("distributed_optimizer", False)
    if zero1:
        kwargs["optimizer"] = ml.OptimizerConfig(
            lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, use_distributed_optimizer=True
        )
    config = _config(**overrides)
    reference = run(tmp_path / "single", devices=1, mbs=kwargs.get("mbs", 2), config=config, steps=2)
    result = run(tmp_path / "parallel", config=config, steps=2, **kwargs)
    # ZeRO-1 moves the gradients into its shards: there the norms, losses and parameters carry the proof
    assert_same_training(result, reference, grads=not zero1)
    assert_same_reports(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


@pytest.mark.parametrize("precision", ["bf16-mixed", "16-true"])
def test_moe_mixed_precision_tracks_fp32(precision, tmp_path):
    """bf16 is not bit-exact and fp16 scales the loss: at EP2, with an aux loss large enough to matter (its gradient
    is back-propagated with the loss scale, or fp16's norm would be off by the scale), both track fp32."""
    config = _config(moe_aux_loss_coeff=1.0, hidden_size=32, num_attention_heads=4, num_query_groups=2)
    kwargs = dict(devices=2, strategy_kwargs=dict(expert_model_parallel_size=2), config=config, steps=3)
    reference = run(tmp_path / "fp32", **kwargs)
    if precision == "16-true":  # a loss scale that does not overflow at the first steps (Megatron starts at 2**32)
        kwargs["optimizer"] = ml.OptimizerConfig(
            lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, initial_loss_scale=2.0**10
        )
    result = run(tmp_path / precision, precision=precision, **kwargs)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(reference["losses"]), rtol=2e-2, atol=0)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=5e-2, atol=0
    )
    if precision == "16-true":
        assert result["loss_scale"] is not None and result["skipped_steps"] == 0


def test_moe_with_batch_rampup_matches_single_process(tmp_path):
    """A growing batch (2, 4, 6, 8 samples) at EP2: the per-micro-batch auxiliary losses follow the microbatch count."""
    from megatron_lite.data import MockGPTDataModule

    config = _config()

    def data():
        return MockGPTDataModule(
            seq_length=config.seq_length,
            micro_batch_size=2,
            global_batch_size=8,
            vocab_size=config.vocab_size,
            seed=7,
            rampup_batch_size=[4, 4, 16],
        )

    optimizer = ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant")
    reference = run(tmp_path / "single", devices=1, config=config, optimizer=optimizer, data=data(), steps=4)
    result = run(
        tmp_path / "ep2",
        devices=2,
        config=config,
        optimizer=optimizer,
        data=data(),
        steps=4,
        strategy_kwargs=dict(expert_model_parallel_size=2),
    )
    assert_same_training(result, reference)
    assert_same_reports(result, reference)

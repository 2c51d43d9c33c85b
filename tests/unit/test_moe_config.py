"""Every impossible or ineffective MoE option is refused when the GPTConfig is built, by name, with the fix."""

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.models.moe_config import check_moe_parallelism, moe_layer_pattern

BASE = dict(num_layers=4, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16, num_moe_experts=8)


@pytest.mark.parametrize(
    "fields, match",
    [
        (dict(num_moe_experts=None, moe_router_topk=4), r"moe_router_topk only applies to a mixture-of-experts model"),
        (dict(moe_router_topk=9), r"moe_router_topk \(9\) must be <= num_moe_experts \(8\)"),
        (dict(moe_router_num_groups=3, moe_router_group_topk=1), r"moe_router_num_groups \(3\) must divide"),
        (dict(moe_router_num_groups=4), r"needs both moe_router_num_groups and moe_router_group_topk"),
        (dict(moe_router_num_groups=4, moe_router_group_topk=5), r"moe_router_group_topk \(5\) must be <="),
        (dict(moe_router_topk=6, moe_router_num_groups=4, moe_router_group_topk=2), r"raise moe_router_group_topk"),
        (dict(moe_expert_capacity_factor=0.0), r"moe_expert_capacity_factor must be > 0"),
        (dict(moe_expert_capacity_factor=-1.0), r"moe_expert_capacity_factor must be > 0"),
        (dict(moe_pad_expert_input_to_capacity=True), r"needs moe_expert_capacity_factor"),
        (dict(moe_token_drop_policy="position"), r"only applies with moe_expert_capacity_factor"),
        (dict(moe_token_dispatcher_type="bogus"), r"moe_token_dispatcher_type must be one of"),
        (dict(moe_token_dispatcher_type="flex"), r"deep_ep is not installed here; use 'alltoall'"),
        (dict(moe_layer_freq=[1, 0, 1]), r"one 0 \(dense\) or 1 \(MoE\) per layer: 4 entries"),
        (dict(moe_layer_freq=0), r"moe_layer_freq must be >= 1"),
        (
            dict(moe_router_load_balancing_type="sinkhorn", moe_aux_loss_coeff=0.01),
            r"moe_aux_loss_coeff=0.01 has no effect with moe_router_load_balancing_type='sinkhorn'",
        ),
        (
            dict(
                moe_router_score_function="sigmoid",
                moe_router_enable_expert_bias=True,
                moe_router_load_balancing_type="sinkhorn",
            ),
            r"moe_router_enable_expert_bias=True has no effect with moe_router_load_balancing_type='sinkhorn'",
        ),
        (dict(moe_router_enable_expert_bias=True), r"needs moe_router_score_function='sigmoid'"),
        (dict(moe_router_score_function="sigmoid", moe_router_pre_softmax=True), r"applies to .*'softmax' only"),
        (dict(moe_shared_expert_gate=True), r"set moe_shared_expert_intermediate_size too"),
        (dict(moe_input_jitter_eps=1.5), r"moe_input_jitter_eps must be in \(0, 1\)"),
    ],
)
def test_bad_moe_options_are_refused_by_name(fields, match):
    with pytest.raises(ValueError, match=match):
        ml.GPTConfig(**{**BASE, **fields})


def test_layer_pattern_and_expert_width_default():
    config = ml.GPTConfig(**BASE, moe_layer_freq=2, ffn_hidden_size=96)
    assert moe_layer_pattern(config) == [True, False, True, False]
    assert config.moe_ffn_hidden_size == 96
    assert moe_layer_pattern(ml.GPTConfig(**{**BASE, "moe_layer_freq": [0, 1, 1, 0]})) == [False, True, True, False]
    assert moe_layer_pattern(ml.GPTConfig(**{**BASE, "num_moe_experts": None})) == [False] * 4


@pytest.mark.parametrize(
    "parallel, fields, match",
    [
        (
            dict(expert_model_parallel_size=3),
            {},
            r"num_moe_experts \(8\) must be divisible by expert_model_parallel_size \(3\)",
        ),
        (
            dict(expert_tensor_parallel_size=3),
            dict(moe_ffn_hidden_size=64),
            r"moe_ffn_hidden_size \(64\) must be divisible",
        ),
        (dict(tensor_model_parallel_size=2), {}, r"needs sequence_parallel=True in training"),
        (dict(expert_model_parallel_size=2), dict(num_moe_experts=None), r"this model has none"),
        (
            dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_tensor_parallel_size=4),
            dict(add_bias_linear=True),
            r"the experts' output bias is reduced over the TP group",
        ),
    ],
)
def test_bad_expert_layouts_are_refused_by_name(parallel, fields, match):
    with pytest.raises(ValueError, match=match):
        check_moe_parallelism(ml.GPTConfig(**{**BASE, **fields}), ml.ParallelConfig(**parallel))


def test_expert_sizes_must_divide_a_pipeline_stage():
    with pytest.raises(ValueError, match=r"1 x 4 = 4 must divide the ranks of a pipeline stage"):
        ml.ParallelConfig(expert_model_parallel_size=4).data_parallel_size(2)
    assert ml.ParallelConfig(tensor_model_parallel_size=2, expert_model_parallel_size=2).data_parallel_size(4) == 2


def test_post_training_tools_refuse_experts_by_name():
    """Quantization, pruning and the quantized HF export know dense MLPs only: an MoE model is refused by name
    before anything runs, rather than quantized or pruned with its experts silently left out."""
    from megatron_lite.callbacks import Quantize
    from megatron_lite.post_training import quantize
    from megatron_lite.post_training.export import quantized_hf_state
    from megatron_lite.post_training.pruning import PruneTarget, prune

    config = ml.GPTConfig(**{**BASE, "num_layers": 2, "make_vocab_size_divisible_by": 8})
    module = ml.GPTModule(config)
    module.configure_model()
    tokens = [{"tokens": torch.randint(0, 64, (2, 17))}]
    for attempt in (
        lambda: quantize(module, "INT8_SMOOTHQUANT_CFG", tokens),
        lambda: prune(module, PruneTarget(num_layers=1), tokens),
        lambda: quantized_hf_state(module.model),
        lambda: Quantize("INT8_SMOOTHQUANT_CFG").check_before_launch(None, None, module, None),
    ):
        with pytest.raises(
            ValueError, match=r"does not handle mixture-of-experts models yet \(this one has num_moe_experts=8\)"
        ):
            attempt()

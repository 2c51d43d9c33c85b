"""LoRA on an MoE model in one process: the experts' layers are adaptable and listed before launch as built, merging
the adapters (one per expert) gives the adapted model's logits, switching them off the base's, the grouped GEMM
gives the loop's adapters, a state dict rebuilds them from its recipe, and an ETP/EP rank's adapters merge into
exactly its shard of the experts' merged weight (SwiGLU's [gate; up] blocks included). Other layouts' ranks are
layouts built by hand, as in test_moe_experts.py."""

from __future__ import annotations

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.models.moe.experts import GroupedExperts
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.random import model_parallel_rng_tracker
from megatron_lite.core.parallel.tensor_parallel import full_shape, initialize_parameter, local_shard
from megatron_lite.core.peft import LoRAConfig, adapters, adapters_disabled, apply_lora, merge_lora, restore_lora
from megatron_lite.core.peft.expert_lora import EXPERT_RNG, EXPERT_SPLIT_RNG, ExpertLoRAAdapter, add_expert_rng_streams
from megatron_lite.core.peft.lora import adaptable_layer_names, adaptable_layers, check_targets


def _config(**overrides) -> ml.GPTConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        seq_length=8,
        ffn_hidden_size=64,
        num_moe_experts=4,
        moe_router_topk=2,
        moe_ffn_hidden_size=16,
        moe_shared_expert_intermediate_size=32,
        activation="swiglu",
    )
    return ml.GPTConfig(**{**base, **overrides})


def _adapted_model(config: ml.GPTConfig) -> ml.GPTModel:
    """An MoE model with adapters everywhere, every B drawn away from zero (as after training)."""
    layout = ParallelLayout.single()
    model = ml.GPTModel(config, layout, seed=3)
    apply_lora(model, LoRAConfig(dim=4, alpha=8), layout, seed=3)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for _, adapter in adapters(model):
            weight = adapter.linear_out.weight
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return model.eval()


TOKENS = torch.randint(0, 100, (2, 8), generator=torch.Generator().manual_seed(1))


def test_the_experts_layers_are_listed_before_launch_as_built():
    config = _config(moe_layer_freq=[1, 0])  # an MoE layer then a dense one
    model = ml.GPTModel(config, ParallelLayout.single(), seed=3)
    names = adaptable_layer_names(config)
    assert names == [name for name, _ in adaptable_layers(model)]
    assert "layers.0.mlp.experts.linear_fc1" in names and "layers.0.mlp.experts.linear_fc2" in names
    assert check_targets(LoRAConfig(target_modules=["*.experts.linear_fc2"]), config) == [
        "layers.0.mlp.experts.linear_fc2"
    ]
    assert "layers.0.mlp.experts.linear_fc1" in check_targets(LoRAConfig(target_modules=["linear_fc1"]), config)


@pytest.mark.parametrize("grouped", [False, True], ids=["loop", "grouped-gemm"])
def test_merge_gives_the_adapted_logits_and_disabled_the_base(grouped):
    config = _config(moe_grouped_gemm=grouped)
    base = ml.GPTModel(config, ParallelLayout.single(), seed=3).eval()
    model = _adapted_model(config)
    assert any(isinstance(adapter, ExpertLoRAAdapter) for _, adapter in adapters(model))
    with torch.no_grad():
        base_logits = base.full_logits(TOKENS)
        adapted = model.full_logits(TOKENS)
        assert (adapted - base_logits).abs().max() > 1e-2  # the experts' adapters change the model
        with adapters_disabled(model):
            torch.testing.assert_close(model.full_logits(TOKENS), base_logits, rtol=0, atol=0)
        merged = merge_lora(model)
        assert "layers.1.mlp.experts.linear_fc1" in merged and "layers.1.mlp.experts.linear_fc2" in merged
        assert not any(True for _ in adapters(model))
        torch.testing.assert_close(model.full_logits(TOKENS), adapted, rtol=1e-5, atol=1e-5)


def test_grouped_gemm_adapters_equal_the_loop():
    with torch.no_grad():
        loop = _adapted_model(_config()).full_logits(TOKENS)
        grouped = _adapted_model(_config(moe_grouped_gemm=True)).full_logits(TOKENS)
    torch.testing.assert_close(grouped, loop, rtol=1e-5, atol=1e-5)


def _rank(ep: int = 1, etp: int = 1, ep_rank: int = 0, etp_rank: int = 0):
    """(experts, their adapters by layer) of one EP x ETP rank: A drawn from the seed, B cut from one whole random
    tensor (what training would have left, the same at every layout)."""
    config = _config(num_layers=1)
    if ep == etp == 1:
        layout = ParallelLayout.single()
    else:
        parallel = ParallelConfig(expert_model_parallel_size=ep, tensor_model_parallel_size=etp)
        layout = ParallelLayout(parallel, ep * etp, ep_rank * etp + etp_rank, coords={"ep": ep_rank, "etp": etp_rank})
    experts = GroupedExperts(config, layout, output_init_std=0.01)
    out = {}
    for fc in ("linear_fc1", "linear_fc2"):
        adapter = ExpertLoRAAdapter(getattr(experts, fc), LoRAConfig(dim=4, alpha=8), layout)
        for name, param in adapter.named_parameters():
            initialize_parameter(f"{fc}.adapter.{name}", param, seed=5)
        b = adapter.linear_out.weight
        whole = torch.randn(full_shape(b), generator=torch.Generator().manual_seed(len(fc)))
        with torch.no_grad():
            b.copy_(local_shard(b, whole))
        out[fc] = adapter
    return experts, out


def test_an_etp_rank_merges_its_shard_of_the_experts_merged_weight():
    _, whole = _rank()
    for ep_rank in range(2):
        for etp_rank in range(2):
            experts, rank = _rank(2, 2, ep_rank, etp_rank)
            for fc, adapter in rank.items():
                weight = getattr(experts, fc).weight  # where this rank's shard sits in the whole experts' weight
                expected = local_shard(weight, whole[fc].delta_weight())
                assert adapter.delta_weight().shape == weight.shape
                torch.testing.assert_close(adapter.delta_weight(), expected, rtol=1e-6, atol=1e-7)


def test_a_state_dict_rebuilds_the_experts_adapters_from_its_recipe():
    config = _config()
    model = _adapted_model(config)
    state = model.state_dict()
    fresh = ml.GPTModel(config, ParallelLayout.single(), seed=11)  # another seed: everything comes from the state
    assert restore_lora(fresh, state, ParallelLayout.single())
    fresh.load_state_dict(state)
    with torch.no_grad():
        torch.testing.assert_close(fresh.eval().full_logits(TOKENS), model.full_logits(TOKENS), rtol=0, atol=0)
    assert any(isinstance(adapter, ExpertLoRAAdapter) for _, adapter in adapters(fresh))


def test_expert_dropout_streams_agree_over_etp_where_the_activation_is_replicated():
    """fc1's input and fc2's partial output are the same on an expert's ETP ranks: their masks must be too (one
    stream seeded alike), while slices (fc2's input, fc1's output) and other EP ranks' experts draw apart."""
    seeds = {}
    for ep_rank in range(2):
        for etp_rank in range(2):
            parallel = ParallelConfig(expert_model_parallel_size=2, tensor_model_parallel_size=2)
            layout = ParallelLayout(parallel, 4, ep_rank * 2 + etp_rank, coords={"ep": ep_rank, "etp": etp_rank})
            tracker = model_parallel_rng_tracker(seed=9, tp_rank=etp_rank)
            add_expert_rng_streams(tracker, layout)
            seeds[ep_rank, etp_rank] = (tracker.seeds[EXPERT_RNG], tracker.seeds[EXPERT_SPLIT_RNG])
    assert seeds[0, 0][0] == seeds[0, 1][0] and seeds[1, 0][0] == seeds[1, 1][0]
    assert seeds[0, 0][0] != seeds[1, 0][0]
    assert len({split for _, split in seeds.values()}) == 4

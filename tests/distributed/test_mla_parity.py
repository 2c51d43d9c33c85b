"""Multi-latent attention through a real Trainer at TP2, EP2 and PP2 equals the single-process run, per step (losses,
the first step's full gradients, the final parameters, the gradient norm): heads split over the up-projections, the
replicated down-projections and latent norms summed over TP -- under sequence parallelism with DeepSeek's MoE (query
compression, YaRN, grouped sigmoid routing with the expert bias, a shared expert, a dense first layer), and without
it on a dense model (the RoPE key's gradient summed over the ranks' heads) with core-attention recompute."""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from mla_utils import TINY_MLA
from parity_utils import assert_same_params, assert_same_training, run, tiny_config

MLA = dict(TINY_MLA, layernorm_epsilon=1e-6)
DEEPSEEK_MOE = dict(
    q_lora_rank=24,
    rope_scaling_type="yarn",
    rope_scaling_factor=4.0,
    rope_original_max_position_embeddings=16,
    rope_mscale=0.8,
    rope_mscale_all_dim=1.0,
    num_moe_experts=4,
    moe_ffn_hidden_size=32,
    moe_layer_freq=[0, 1],
    moe_router_topk=2,
    moe_router_score_function="sigmoid",
    moe_router_enable_expert_bias=True,
    moe_router_num_groups=2,
    moe_router_group_topk=1,
    moe_router_topk_scaling_factor=2.5,
    moe_shared_expert_intermediate_size=32,
)
CASES = {
    "tp2-sp-deepseek-moe": (DEEPSEEK_MOE, dict(tp=2, sp=True)),
    "tp2-dense-no-q-lora-recompute": (dict(recompute_granularity="selective"), dict(tp=2)),
    # DeepSeek's MoE with its experts split over two ranks, and cut into two pipeline stages (the dense first layer on
    # one, the MoE layer on the other; the zero-bubble split defers the MLA projections' weight GEMMs)
    "ep2-deepseek-moe": (DEEPSEEK_MOE, dict(strategy_kwargs=dict(expert_model_parallel_size=2))),
    "pp2-zb1p-deepseek-moe": (DEEPSEEK_MOE, dict(pp=2, strategy_kwargs=dict(pipeline_schedule="zb1p"))),
    # the combined layout: 8 ranks, the MoE layer's experts over EP2 x ETP2 inside its pipeline stage
    "tp2-sp-ep2-pp2-deepseek-moe": (
        DEEPSEEK_MOE,
        dict(devices=8, tp=2, sp=True, pp=2, mbs=1, strategy_kwargs=dict(expert_model_parallel_size=2)),
    ),
}


@pytest.fixture(scope="module")
def references(tmp_path_factory):
    """One-process runs per (model options, micro-batch size), made once: the layouts of one model share theirs."""
    cache: dict = {}

    def reference(overrides: dict, mbs: int) -> dict:
        key = (repr(sorted(overrides.items())), mbs)
        if key not in cache:
            config = tiny_config(**MLA, **overrides)
            cache[key] = run(tmp_path_factory.mktemp("single"), devices=1, config=config, steps=2, mbs=mbs)
        return cache[key]

    return reference


@pytest.mark.parametrize("name", list(CASES))
def test_mla_layout_matches_single_process(name, references, tmp_path):
    overrides, layout = CASES[name]
    config = tiny_config(**MLA, **overrides)
    reference = references(overrides, layout.get("mbs", 2))
    result = run(tmp_path / "parallel", config=config, steps=2, **{"devices": 2, **layout})
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


def test_a_deepseek_checkpoint_saved_at_tp2_sp_ep2_pp2_continues_at_cp2_ep2(tmp_path):
    """Resharding a DeepSeek-V3-class model (MLA with query compression and YaRN, DeepSeek's MoE, a dense first layer,
    an MTP depth): saved at TP2+SP x PP2 with its experts over EP2 (4 ranks: the heads' up-projections split over TP,
    the replicated down-projections and latent norms, the MTP block and its embedding copy on the last stage), it
    loads at CP2 x EP2 (whole heads, every layer and the MTP block on each rank, the sequence split) and continues
    the run exactly: its losses and final parameters (Adam's moments resharded with them) are the source's."""
    config = tiny_config(**MLA, **DEEPSEEK_MOE, mtp_num_layers=1)
    saving = ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=2, save_top_k=-1)
    source = run(
        tmp_path / "tp2pp2",
        devices=4,
        tp=2,
        sp=True,
        pp=2,
        config=config,
        steps=4,
        callbacks=[saving],
        strategy_kwargs=dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1),
    )
    checkpoint = str(tmp_path / "ckpts" / "epoch=0-step=2.ckpt")
    resumed = run(
        tmp_path / "cp2",
        devices=2,
        config=config,
        steps=4,
        ckpt_path=checkpoint,
        strategy_kwargs=dict(context_parallel_size=2, expert_model_parallel_size=2),
    )
    assert resumed["global_step"] == 4
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(source["losses"][2:]), rtol=1e-5, atol=0)
    assert_same_params(resumed, source, rtol=1e-5)

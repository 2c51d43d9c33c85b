"""Multi-token prediction through a real Trainer equals the single-process run, per step (losses, the reported
MTP loss, the first step's full gradients, the final parameters): at TP2 with sequence parallelism (the MTP layer's
projection gathered over TP and scattered over the sequence) and at PP2, where the block sits on the last stage
with its own copy of the (untied) embedding, whose gradient is summed with the first stage's, and in a V placement;
at CP2 (the reported MTP loss summed over CP) with 'full' recompute of the decoder's and the MTP block's layers."""

import pytest
from parity_utils import assert_same_training, run, tiny_config

MTP = dict(mtp_num_layers=2, mtp_loss_scaling_factor=0.5, seq_length=16)
LAYOUTS = {
    "tp2-sp": dict(devices=2, tp=2, sp=True),
    "pp2": dict(devices=2, pp=2),
    # a V placement: the last stage (and the MTP block) on rank 0 with the first, one embedding serving both; the
    # layout names the MTP layer before the loss as Megatron's DeepSeek-V3 layouts do
    "pp2-zbv": dict(
        devices=2,
        pp=2,
        vpp=2,
        strategy_kwargs=dict(pipeline_model_parallel_layout="E|t|t|mmL", pipeline_schedule="zbv"),
    ),
    # CP2, the shifts crossing the ranks' chunks, with the decoder's and the MTP depths' layers recomputed: tiny_config
    # has no dropout, so recomputation changes no value and the same reference proves it exact
    "cp2-full-recompute": dict(
        devices=2,
        strategy_kwargs=dict(context_parallel_size=2),
        config=dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
    ),
}


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single"), devices=1, config=tiny_config(**MTP), steps=2, gbs=4)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_mtp_matches_single_process(name, reference, tmp_path):
    layout = dict(LAYOUTS[name])
    config = tiny_config(**MTP, **layout.pop("config", {}))
    result = run(tmp_path, config=config, steps=2, gbs=4, **layout)
    assert_same_training(result, reference)
    assert reference["reported"][0]["train/mtp_loss"] > 0
    for got, want in zip(result["reported"], reference["reported"]):
        assert got.keys() == want.keys()
        for metric, value in want.items():
            assert got[metric] == pytest.approx(value, rel=1e-5), metric

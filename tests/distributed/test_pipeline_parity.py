"""Pipeline parallelism through a real Trainer equals the single-process run.

Same seed, same mock data, same global batch: the 10 per-step losses, the first step's full
gradients (gathered from every stage) and the final parameters match to fp32 tolerance (rtol 1e-5).
"""

import json

import lightning as L
import pytest
import torch
from parity_utils import assert_same_training, run, tiny_config

import megatron_lite as ml

CONFIG = dict(num_layers=4)
LAYOUTS = {
    "pp2": dict(devices=2, pp=2),
    "pp4": dict(devices=4, pp=4),
    "pp2_vpp2": dict(devices=2, pp=2, vpp=2),
    "pp2_gpipe": dict(devices=2, pp=2, strategy_kwargs=dict(pipeline_schedule="gpipe")),
    "pp2_uneven": dict(devices=2, pp=2, strategy_kwargs=dict(num_layers_in_first_pipeline_stage=1)),
    # Megatron's asymmetric layout: the embedding alone on virtual stage 0 and the loss alone on the last (3), so
    # rank 0 holds no layer in its first chunk and layers 2, 3 in its second
    "pp2_vpp2_layout": dict(
        devices=2,
        pp=2,
        vpp=2,
        strategy_kwargs=dict(pipeline_model_parallel_layout="E|tt|tt|L"),
        rank0_layers=[[], [2, 3]],
    ),
    "pp2_zbv_layout": dict(  # the V placement takes the layout's stages in pipeline order: stages 0 and 3 on rank 0
        devices=2,
        pp=2,
        vpp=2,
        strategy_kwargs=dict(pipeline_model_parallel_layout="Et|t|t|tL", pipeline_schedule="zbv"),
        rank0_layers=[[0], [3]],
    ),
    "tp2_pp2_sp": dict(devices=4, pp=2, tp=2, sp=True),
    "pp2_dp2": dict(devices=4, pp=2, mbs=1),
    "pp2_distopt": dict(devices=2, pp=2, distributed_optimizer=True),
    "tp2_pp2_sp_zb1p": dict(devices=4, pp=2, tp=2, sp=True, strategy_kwargs=dict(pipeline_schedule="zb1p")),
    "pp2_dp2_distopt_overlap_zb1p": dict(
        devices=4,
        pp=2,
        mbs=1,
        distributed_optimizer=True,
        strategy_kwargs=dict(overlap_grad_reduce=True, ddp_bucket_size=2000, pipeline_schedule="zb1p"),
    ),
    "pp2_dp2_distopt_overlap_zbv": dict(  # two chunks per rank, each reducing after its own last W
        devices=4,
        pp=2,
        vpp=2,
        mbs=1,
        distributed_optimizer=True,
        strategy_kwargs=dict(overlap_grad_reduce=True, ddp_bucket_size=2000, pipeline_schedule="zbv"),
    ),
    "pp2_dualpipev": dict(devices=2, pp=2, vpp=2, strategy_kwargs=dict(pipeline_schedule="dualpipev")),
    "pp2_dp2_distopt_overlap": dict(
        devices=4,
        pp=2,
        mbs=1,
        distributed_optimizer=True,
        strategy_kwargs=dict(overlap_grad_reduce=True, ddp_bucket_size=2000),
    ),
}


def _run(path, distributed_optimizer=False, tied=False, **kwargs):
    config = tiny_config(**CONFIG, share_embeddings_and_output_weights=tied)
    optimizer = None
    if distributed_optimizer:
        optimizer = ml.OptimizerConfig(
            lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, use_distributed_optimizer=True
        )
    return run(path, config=config, optimizer=optimizer, **kwargs)


class Rank0Layers(L.Callback):
    """Global rank 0 (the first pipeline rank) writes the global indices of the layers of each of its chunks."""

    def __init__(self, out):
        self.out = out

    def on_train_start(self, trainer, pl_module):
        if trainer.global_rank == 0:
            chunks = [list(chunk.stage.layers) for chunk in pl_module.model.chunks]
            (self.out / "rank0_layers.json").write_text(json.dumps(chunks))


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), devices=1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_pipeline_layout_matches_single_process(name, reference, tmp_path):
    kwargs = dict(LAYOUTS[name])
    rank0_layers = kwargs.pop("rank0_layers", None)
    result = _run(tmp_path, callbacks=[Rank0Layers(tmp_path)], **kwargs)
    assert result["global_step"] == 10
    if rank0_layers is not None:  # the cut asked for is the one that ran
        assert json.loads((tmp_path / "rank0_layers.json").read_text()) == rank0_layers
    if kwargs.get("strategy_kwargs", {}).get("overlap_grad_reduce"):
        # reductions launched from the hooks of each chunk's last backward (a zero-bubble schedule's: last W)
        assert result["overlapped_reductions"] > 0
    # The distributed optimizer moves gradients into its DP shards: compared through the norm and the step.
    assert_same_training(result, reference, grads=not kwargs.get("distributed_optimizer"))
    # train/grad_norm is one norm over every stage's gradients (what clipping uses).
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


TIED = {
    "pp2": LAYOUTS["pp2"],
    "pp4": LAYOUTS["pp4"],
    "pp2_zb1p": dict(devices=2, pp=2, strategy_kwargs=dict(pipeline_schedule="zb1p")),
    "pp2_zbv": dict(devices=2, pp=2, vpp=2, strategy_kwargs=dict(pipeline_schedule="zbv")),
}


@pytest.fixture(scope="module")
def tied_reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single_tied"), devices=1, tied=True, steps=5)


@pytest.mark.parametrize("layout", list(TIED))
def test_tied_embeddings_match_single_process(layout, tied_reference, tmp_path):
    """The tied embedding lives on the first and last stage; its gradient is summed over both (in a V placement both
    stages are on rank 0, which holds one embedding for both)."""
    reference = tied_reference
    result = _run(tmp_path / layout, tied=True, steps=5, **TIED[layout])
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


@pytest.mark.slow
def test_tp2_pp2_dp2_on_eight_ranks(reference, tmp_path):
    result = _run(tmp_path, devices=8, tp=2, pp=2, mbs=1)
    assert_same_training(result, reference)


@pytest.fixture(scope="module")
def four_step_reference(tmp_path_factory):
    return run(tmp_path_factory.mktemp("single_4"), devices=1, config=tiny_config(**CONFIG), steps=4)


@pytest.mark.parametrize("schedule", ["1f1b", "zbv"])
def test_recompute_composes_with_pipeline(schedule, four_step_reference, tmp_path):
    """Full recomputation under the zero-bubble split too: the input-gradient pass recomputes the layer and defers
    its weight GEMMs like any backward."""
    recompute = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
    reference = four_step_reference
    vpp = 2 if schedule == "zbv" else 1
    config = tiny_config(**CONFIG, **recompute)
    kwargs = dict(devices=2, pp=2, vpp=vpp, strategy_kwargs=dict(pipeline_schedule=schedule))
    result = run(tmp_path / "pp2", config=config, steps=4, **kwargs)
    assert_same_training(result, reference)


def test_rampup_composes_with_pipeline(tmp_path):
    """Steps of a growing batch (2, 4, 6, 8 samples: 1 to 4 microbatches) through 1F1B."""
    from megatron_lite.data import MockGPTDataModule

    config = tiny_config(**CONFIG)

    def data():
        return MockGPTDataModule(
            seq_length=config.seq_length,
            micro_batch_size=2,
            global_batch_size=8,
            vocab_size=config.vocab_size,
            seed=7,
            rampup_batch_size=[2, 2, 24],
        )

    optimizer = ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant")
    reference = run(tmp_path / "single", devices=1, config=config, optimizer=optimizer, data=data(), steps=6)
    result = run(tmp_path / "pp2", devices=2, pp=2, config=config, optimizer=optimizer, data=data(), steps=6)
    assert_same_training(result, reference)


@pytest.mark.parametrize("precision, schedule", [("bf16-true", "zb1p"), ("bf16-mixed", "1f1b")])
def test_bf16_under_pipeline_tracks_fp32(precision, schedule, reference, tmp_path):
    """bf16 is not bit-exact: it must run through the stages and track fp32 to bf16 tolerance (bf16 parameters with the
    zero-bubble split: its weight pass computes their gradients in bf16, as autograd does)."""
    strategy = dict(pipeline_schedule=schedule)
    result = _run(tmp_path, devices=2, pp=2, precision=precision, strategy_kwargs=strategy)
    losses, ref = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, ref, rtol=2e-2, atol=0)


@pytest.mark.parametrize("schedule", ["1f1b", "zb1p"])
def test_fp16_loss_scaling_under_pipeline(schedule, tmp_path):
    """16-true on a tiny model: Megatron's 2**32 initial scale overflows, steps are skipped on every
    stage together and the scale backs off until training proceeds."""
    config = tiny_config(num_layers=2, hidden_size=32, num_attention_heads=4, num_query_groups=2, seq_length=16)
    strategy = dict(pipeline_schedule=schedule)
    result = run(
        tmp_path, devices=2, pp=2, config=config, precision="16-true", steps=6, gbs=4, strategy_kwargs=strategy
    )
    assert result["skipped_steps"] >= 1
    assert result["loss_scale"] < 2.0**32
    assert all(torch.isfinite(torch.tensor(result["losses"])))

"""Distributed optimizer (ZeRO-1), FSDP2 and global clipping through a real Trainer equal the
plain single-process run: same seed and data, 10 steps, fp32, per-step losses (rtol 1e-5), the
final parameters (relative error 1e-5) and, where the model holds them, the first step's gradients.

Clipping is active in every run here (``clip_grad`` below the gradient norm of every step, checked),
so a norm that missed a shard or counted a replica twice would change the update.
"""

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from parity_utils import assert_same_training, run

import megatron_lite as ml

CLIP = 0.5


def optimizer(**kwargs) -> ml.OptimizerConfig:
    return ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, clip_grad=CLIP, **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    result = run(tmp_path_factory.mktemp("single"), devices=1, optimizer=optimizer())
    assert min(result["grad_norms"]) > CLIP, "clipping must be active in every step for these tests to bite"
    return result


DISTRIBUTED_OPTIMIZER = {
    "dp2": dict(devices=2),
    "dp2_small_buckets": dict(devices=2, strategy_kwargs=dict(ddp_bucket_size=3000)),
    "dp4": dict(devices=4, mbs=1),
    "tp2_dp2_sp": dict(devices=4, tp=2, sp=True),
    # 4 microbatches a step; buckets reduce-scatter asynchronously during the last one's backward
    "dp2_overlap": dict(devices=2, mbs=1, strategy_kwargs=dict(ddp_bucket_size=3000, overlap_grad_reduce=True)),
    "tp2_dp2_sp_overlap": dict(devices=4, tp=2, sp=True, mbs=1, strategy_kwargs=dict(overlap_grad_reduce=True)),
}


@pytest.mark.parametrize("name", list(DISTRIBUTED_OPTIMIZER))
def test_distributed_optimizer_matches_single_process(name, reference, tmp_path):
    result = run(tmp_path, optimizer=optimizer(use_distributed_optimizer=True), **DISTRIBUTED_OPTIMIZER[name])
    assert result["global_step"] == 10
    if name.endswith("overlap"):  # every bucket of every step was reduced during the backward
        assert result["overlapped_reductions"] >= 10 and result["overlapped_reductions"] % 10 == 0
    # The reduced gradients live in the optimizer's DP shards, not in the model.
    assert_same_training(result, reference, grads=False)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


FSDP = {
    "dp2": dict(devices=2),
    "tp2_dp2_sp": dict(devices=4, tp=2, sp=True),
}


@pytest.mark.parametrize("name", list(FSDP))
def test_fsdp2_matches_single_process(name, reference, tmp_path):
    kwargs = dict(FSDP[name])
    result = run(tmp_path, optimizer=optimizer(), strategy_kwargs=dict(use_torch_fsdp2=True), **kwargs)
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


PLAIN_OVERLAP = {
    # Plain DP: each bucket is all-reduced asynchronously during the last microbatch's backward.
    "dp2_overlap": dict(devices=2, mbs=1, strategy_kwargs=dict(ddp_bucket_size=3000, overlap_grad_reduce=True)),
    "tp2_dp2_sp_overlap": dict(devices=4, tp=2, sp=True, mbs=1, strategy_kwargs=dict(overlap_grad_reduce=True)),
}


@pytest.mark.parametrize("name", list(PLAIN_OVERLAP))
def test_plain_dp_overlapped_all_reduce_matches_single_process(name, reference, tmp_path):
    result = run(tmp_path, optimizer=optimizer(), **PLAIN_OVERLAP[name])
    assert result["overlapped_reductions"] >= 10 and result["overlapped_reductions"] % 10 == 0
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


def test_plain_dp_and_tp_clip_like_the_single_process(reference, tmp_path):
    result = run(tmp_path, devices=4, tp=2, sp=True, optimizer=optimizer())
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )


def test_distributed_optimizer_checkpoint_resumes_exactly_and_loads_into_another_layout(reference, tmp_path):
    """Save at step 5 with ZeRO-1 on DP2; resume with ZeRO-1 on DP4 and with the plain optimizer on one
    process: steps 6-10 equal the uninterrupted run (the checkpoint holds per-parameter state, not shards)."""
    ckpt_dir = tmp_path / "ckpts"
    run(
        tmp_path / "first",
        devices=2,
        steps=5,
        optimizer=optimizer(use_distributed_optimizer=True),
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)],
    )
    saved = str(ckpt_dir / "epoch=0-step=5.ckpt")
    for name, kwargs in {
        "zero1_dp4": dict(devices=4, mbs=1, optimizer=optimizer(use_distributed_optimizer=True)),
        "plain_single": dict(devices=1, optimizer=optimizer()),
    }.items():
        resumed = run(tmp_path / name, steps=10, ckpt_path=saved, **kwargs)
        assert resumed["global_step"] == 10
        torch.testing.assert_close(
            torch.tensor(resumed["losses"]),
            torch.tensor(reference["losses"][5:]),
            rtol=1e-5,
            atol=0,
            msg=lambda m, name=name: f"{name}: {m}",
        )


def test_fsdp2_checkpoint_resumes_exactly(reference, tmp_path):
    ckpt_dir = tmp_path / "ckpts"
    fsdp = dict(use_torch_fsdp2=True)
    run(
        tmp_path / "first",
        devices=2,
        steps=5,
        optimizer=optimizer(),
        strategy_kwargs=fsdp,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=5, save_top_k=-1)],
    )
    saved = str(ckpt_dir / "epoch=0-step=5.ckpt")
    resumed = run(
        tmp_path / "resumed", devices=2, steps=10, optimizer=optimizer(), strategy_kwargs=fsdp, ckpt_path=saved
    )
    torch.testing.assert_close(
        torch.tensor(resumed["losses"]), torch.tensor(reference["losses"][5:]), rtol=1e-5, atol=0
    )
    plain = run(tmp_path / "plain", devices=1, steps=10, optimizer=optimizer(), ckpt_path=saved)
    torch.testing.assert_close(torch.tensor(plain["losses"]), torch.tensor(reference["losses"][5:]), rtol=1e-5, atol=0)


def test_bf16_weights_with_zero1_track_one_process(tmp_path):
    """bf16 parameters, fp32 main grads and masters sharded over DP2: close to the one-process bf16 run
    (bf16 products are not bit-reproducible across batch splits, hence the bf16-level tolerance)."""
    single = run(tmp_path / "one", devices=1, steps=6, optimizer=optimizer(), precision="bf16-true")
    zero1 = run(
        tmp_path / "dp2", devices=2, steps=6, optimizer=optimizer(use_distributed_optimizer=True), precision="bf16-true"
    )
    torch.testing.assert_close(torch.tensor(zero1["losses"]), torch.tensor(single["losses"]), rtol=5e-3, atol=0)
    for name, ref in single["params"].items():
        assert (zero1["params"][name] - ref).norm() <= 1e-2 * ref.norm(), name


@pytest.mark.parametrize("distributed", [False, True], ids=["plain", "zero1"])
def test_fp16_checkpoint_written_while_every_step_overflowed_resumes(tmp_path, distributed):
    """Megatron's 2**32 start skips the first steps: a checkpoint then holds no optimizer state for any
    parameter (only the loss scaler's); resuming must load what is there and continue the backing-off."""
    fp16 = optimizer(use_distributed_optimizer=distributed, initial_loss_scale=2.0**40, hysteresis=1)
    ckpt_dir = tmp_path / "ckpts"
    first = run(
        tmp_path / "first",
        devices=2,
        steps=2,
        optimizer=fp16,
        precision="16-true",
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=2, save_top_k=-1)],
    )
    assert first["skipped_steps"] == 2 and first["loss_scale"] == 2.0**38
    resumed = run(
        tmp_path / "resumed",
        devices=2,
        steps=4,
        optimizer=fp16,
        precision="16-true",
        ckpt_path=str(ckpt_dir / "epoch=0-step=2.ckpt"),
    )
    full = run(tmp_path / "full", devices=2, steps=4, optimizer=fp16, precision="16-true")
    assert resumed["loss_scale"] == full["loss_scale"] and resumed["skipped_steps"] == full["skipped_steps"]
    torch.testing.assert_close(torch.tensor(resumed["losses"]), torch.tensor(full["losses"][2:]), rtol=1e-3, atol=0)


def test_fsdp2_predict_gives_the_full_model_logits(tmp_path):
    """predict_step under FSDP2 (DP2): the sharded model all-gathers in its hooks and returns the logits
    of the unsharded model."""
    import lightning as L
    from parity_utils import tiny_config
    from torch.utils.data import DataLoader

    import megatron_lite as ml

    config = tiny_config()
    tokens = torch.randint(0, config.vocab_size, (2, config.seq_length), generator=torch.Generator().manual_seed(1))

    class Save(L.Callback):
        def on_predict_batch_end(self, trainer, pl_module, outputs, batch, batch_idx, dataloader_idx=0):
            if trainer.global_rank == 0:
                torch.save(outputs.cpu(), tmp_path / "logits.pt")

    class Data(L.LightningDataModule):
        def predict_dataloader(self):
            return DataLoader([{"tokens": tokens}], batch_size=None)

    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", use_torch_fsdp2=True, log_metrics=False),
        devices=2,
        accelerator="cpu",
        logger=False,
        enable_progress_bar=False,
        use_distributed_sampler=False,
        callbacks=[Save()],
    )
    trainer.predict(ml.GPTModule(config, seed=1234), Data(), return_predictions=False)
    expected = ml.GPTModel(config, seed=1234).eval().full_logits(tokens)
    torch.testing.assert_close(torch.load(tmp_path / "logits.pt"), expected, rtol=1e-5, atol=1e-5)

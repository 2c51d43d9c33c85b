"""Context parallelism through a real Trainer equals the single-process run.

Same seed, same data, same global batch, fp32: the 10 per-step losses, the first step's full gradients,
the gradient norms and the final parameters match one process to rtol 1e-5 for CP2, CP4, TP2xCP2 with
sequence parallelism, CP2xDP2, CP2xPP2, CP2 on packed SFT rows, CP2 with the distributed optimizer, the
all-gather exchange and selective recompute. Each CP rank only ever sees its zigzag share of every
sequence (checked on the microbatches the engine is given), so equality proves the exchange of keys and
values, the RoPE positions of the chunks, the loss and token reduction over CP and the gradient reduction
over the data x context parallel group, end to end.
"""

from pathlib import Path

import lightning as L
import pytest
import test_sft_parity
import torch
from parity_utils import assert_same_training, run, tiny_config
from torch.utils.data import DataLoader

import megatron_lite as ml
from megatron_lite.data import MockGPTDataModule

packed_sft_data = test_sft_parity._data
sft_file = test_sft_parity.sft_file  # the fixture that writes the chat JSONL the packed run reads

SEQ = 32  # 2C chunks of 4 (C = 4) to 8 (C = 2) tokens
LAYOUTS = {
    "cp2": dict(devices=2, cp=2),
    "cp4": dict(devices=4, cp=4),
    "tp2_cp2_sp": dict(devices=4, cp=2, tp=2, sp=True),
    "cp2_dp2": dict(devices=4, cp=2),
    "cp2_pp2": dict(devices=4, cp=2, pp=2),
    "cp2_pp2_zb1p": dict(devices=4, cp=2, pp=2, pipeline_schedule="zb1p"),
    "cp2_distopt": dict(devices=2, cp=2, distributed_optimizer=True),
    "cp2_all_gather": dict(devices=2, cp=2, cp_comm_type="all_gather"),
    "cp2_selective_recompute": dict(devices=2, cp=2, recompute="selective"),
}


class ShareRecorder(L.Callback):
    """Records, on global rank 0 at the first step, the shapes and positions of the microbatches the
    engine is given, and the Lightning batch's shape (which must stay whole)."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.seen: dict = {}

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        if batch_idx == 0:
            share = pl_module.step_microbatches(batch)[0]
            self.seen = {
                "batch_tokens": tuple(batch["tokens"].shape),
                "tokens": tuple(share["tokens"].shape),
                "labels": tuple(share["labels"].shape),
                "positions": share["position_ids"][0].tolist(),
                "cp_rank": pl_module.parallel_layout.cp_rank,
            }

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save(self.seen, self.out / "share.pt")


def _run(
    path, *, cp=1, cp_comm_type="p2p", distributed_optimizer=False, recompute=None, pipeline_schedule=None, **kwargs
):
    config = tiny_config(seq_length=SEQ, **({"recompute_granularity": recompute} if recompute else {}))
    optimizer = None
    if distributed_optimizer:
        optimizer = ml.OptimizerConfig(
            lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, use_distributed_optimizer=True
        )
    strategy = dict(context_parallel_size=cp, cp_comm_type=cp_comm_type, pipeline_schedule=pipeline_schedule)
    return run(path, config=config, optimizer=optimizer, strategy_kwargs=strategy, **kwargs)


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("single"), devices=1)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_context_parallel_layout_matches_single_process(name, reference, tmp_path):
    kwargs = LAYOUTS[name]
    result = _run(tmp_path, callbacks=[ShareRecorder(tmp_path)], **kwargs)
    assert result["global_step"] == 10
    # The distributed optimizer moves gradients into its shards: compared through the norm and the step.
    assert_same_training(result, reference, grads=not kwargs.get("distributed_optimizer"))
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )
    share, cp = torch.load(tmp_path / "share.pt"), kwargs["cp"]
    chunk = SEQ // (2 * cp)
    assert share["batch_tokens"][1] == SEQ + 1  # the Lightning batch is left whole
    assert share["tokens"][1] == share["labels"][1] == SEQ // cp
    first, second = share["cp_rank"], 2 * cp - 1 - share["cp_rank"]
    assert share["positions"] == [
        *range(first * chunk, (first + 1) * chunk),
        *range(second * chunk, (second + 1) * chunk),
    ]


def test_packed_sft_rows_under_cp2_match_single_process(sft_file, tmp_path):
    """Packed rows (several conversations per row, ``cu_seqlens`` and per-document positions): each
    document is split over the CP ranks by the same zigzag and never attends across a boundary."""
    config = tiny_config(vocab_size=50257, seq_length=64, make_vocab_size_divisible_by=64)
    reference = run(tmp_path / "single", devices=1, config=config, steps=4, data=packed_sft_data(sft_file))
    result = run(
        tmp_path / "cp2",
        devices=2,
        config=config,
        steps=4,
        data=packed_sft_data(sft_file),
        strategy_kwargs=dict(context_parallel_size=2),
    )
    assert_same_training(result, reference)


def test_gpt2_style_model_with_learned_positions_under_cp2_matches_single_process(tmp_path):
    """Learned absolute positions are looked up at each chunk's global positions (LayerNorm, GeLU, biases)."""
    config = tiny_config(
        seq_length=SEQ,
        normalization="LayerNorm",
        activation="gelu",
        position_embedding_type="learned_absolute",
        add_bias_linear=True,
    )
    reference = run(tmp_path / "single", devices=1, config=config, steps=4)
    result = run(tmp_path / "cp2", devices=2, config=config, steps=4, strategy_kwargs=dict(context_parallel_size=2))
    # Not the final parameters: the key bias has a zero gradient in exact arithmetic (softmax ignores a shift
    # of every score), so Adam turns its rounding noise into steps of ~lr whose sign depends on the order of
    # the sums; the losses and every gradient are compared.
    assert_same_training(result, reference, params=False)


class ValidationLoss(L.Callback):
    """Saves rank 0's ``val/loss`` after each validation."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.losses: list = []

    def on_validation_end(self, trainer, pl_module):
        if not trainer.sanity_checking:
            self.losses.append(float(trainer.callback_metrics["val/loss"]))

    def on_train_end(self, trainer, pl_module):
        if trainer.global_rank == 0:
            torch.save(self.losses, self.out / "val.pt")


def test_validation_loss_under_cp2_matches_single_process(tmp_path):
    """Validation runs the same CP split (forward only): the epoch's loss equals one process's."""
    losses = {}
    for name, kwargs in (("single", dict(devices=1)), ("cp2", dict(devices=2, cp=2))):
        out = tmp_path / name
        out.mkdir()
        _run(
            out,
            steps=4,
            limit_val_batches=2,
            val_check_interval=2,
            num_sanity_val_steps=0,
            callbacks=[ValidationLoss(out)],
            **kwargs,
        )
        losses[name] = torch.load(out / "val.pt")
    assert len(losses["cp2"]) == 2
    torch.testing.assert_close(torch.tensor(losses["cp2"]), torch.tensor(losses["single"]), rtol=1e-5, atol=0)


def test_fit_then_predict_under_cp2_give_the_whole_sequences_logits():
    """After a CP2 fit the trained model comes back whole; predict under CP2 runs whole sequences on every
    CP rank (context parallelism is for training and evaluation steps) and returns this process's logits."""
    module = ml.GPTModule(tiny_config(seq_length=SEQ), seed=1234)
    data = MockGPTDataModule(seq_length=SEQ, micro_batch_size=2, global_batch_size=4, vocab_size=1000, seed=7)

    def trainer(**kwargs):
        return L.Trainer(
            strategy=ml.MegatronStrategy(context_parallel_size=2, start_method="fork"),
            accelerator="cpu",
            devices=2,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            **kwargs,
        )

    trainer(max_steps=3, limit_val_batches=0).fit(module, data)
    samples = [{"tokens": (torch.arange(SEQ) * (i + 1)) % 1000} for i in range(3)]
    predictions = trainer().predict(module, DataLoader(samples, batch_size=2))
    tokens = torch.stack([s["tokens"] for s in samples])
    torch.testing.assert_close(torch.cat(predictions), module.model.eval().full_logits(tokens), rtol=1e-5, atol=1e-5)
    fresh = ml.GPTModule(tiny_config(seq_length=SEQ), seed=1234).build_model(ml.ParallelLayout.single())
    assert not torch.allclose(fresh.full_logits(tokens), torch.cat(predictions), atol=1e-3), "predicted untrained"


def test_checkpoint_saved_under_cp2_resumes_under_cp2_and_in_one_process(tmp_path):
    """Save at step 3 under CP2 with the distributed optimizer (its state sharded over the two CP ranks), resume
    under CP2 and in one process: steps 4-6 equal an uninterrupted run's."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    kwargs = dict(cp=2, distributed_optimizer=True)
    full = _run(tmp_path / "full", devices=2, steps=6, **kwargs)
    ckpt_dir = tmp_path / "ckpts"
    _run(
        tmp_path / "first",
        devices=2,
        steps=3,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=3, save_top_k=-1)],
        **kwargs,
    )
    saved = str(ckpt_dir / "epoch=0-step=3.ckpt")
    resumed = _run(tmp_path / "resumed", devices=2, steps=6, ckpt_path=saved, **kwargs)
    alone = _run(tmp_path / "alone", devices=1, steps=6, ckpt_path=saved, distributed_optimizer=True)
    for result in (resumed, alone):
        assert result["global_step"] == 6
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(full["losses"][3:]), rtol=1e-5, atol=0)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_bf16_under_cp2_tracks_fp32(precision, reference, tmp_path):
    """bf16 is not bit-exact (under autocast the block matmuls run in bf16; the log-sum-exp merge stays in fp32):
    it must train through the CP exchange and track fp32 to bf16 tolerance."""
    result = _run(tmp_path, devices=2, cp=2, precision=precision)
    losses, ref = torch.tensor(result["losses"]), torch.tensor(reference["losses"])
    assert torch.isfinite(losses).all()
    torch.testing.assert_close(losses, ref, rtol=2e-2, atol=0)

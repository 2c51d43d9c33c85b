"""The Checkpointer's own surface, without Lightning, in one process: save -> load of a model with dropout, its
MegatronOptimizer (fp32 masters of a bf16 model, Adam state) and the RNG states resumes training exactly; a
background save is a snapshot of the moment it was asked for, visible once waited for, and close() ends its
thread; a training save is its folder's latest, a writer's output never is. And MegatronStrategy refuses a
CheckpointIO plugin, which it could not honour, at construction."""

from __future__ import annotations

import threading

import lightning.pytorch as L
import pytest
import torch
from lightning.pytorch.plugins.io import AsyncCheckpointIO, TorchCheckpointIO

import megatron_lite as ml
from megatron_lite.core.checkpoint import Checkpointer
from megatron_lite.core.checkpoint.format.integrity import verify_checkpoint
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta, resolve_checkpoint
from megatron_lite.core.optim.optimizer import MegatronOptimizer
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.pretrained import save_weights_checkpoint

CONFIG = dict(
    num_layers=2,
    hidden_size=32,
    num_attention_heads=4,
    vocab_size=64,
    seq_length=16,
    make_vocab_size_divisible_by=8,
    hidden_dropout=0.2,
    attention_dropout=0.2,
)
OPTIMIZER = ml.OptimizerConfig(lr=1e-2, lr_decay_style="constant", clip_grad=1.0)


def _model_and_optimizer(seed: int) -> tuple[ml.GPTModel, MegatronOptimizer]:
    model = ml.GPTModel(ml.GPTConfig(**CONFIG), seed=seed).to(torch.bfloat16).train()
    return model, MegatronOptimizer(model, OPTIMIZER, ParallelLayout.single())


def _train(model: ml.GPTModel, optimizer: MegatronOptimizer, steps: int) -> list[float]:
    """Steps on random batches drawn from the global CPU generator; dropout draws from the model's streams."""
    losses = []
    for _ in range(steps):
        tokens = torch.randint(0, CONFIG["vocab_size"], (2, CONFIG["seq_length"] + 1))
        optimizer.zero_grad()
        loss = model(tokens[:, :-1], labels=tokens[:, 1:]).float().mean()
        loss.backward()
        result = optimizer.prepare_step()
        optimizer.optimizer.step()
        optimizer.finish_step(result)
        losses.append(loss.item())
    return losses


def _weights(model) -> dict[str, torch.Tensor]:
    return {name: param.detach().clone() for name, param in model.named_parameters()}


def test_save_then_load_resumes_training_exactly(tmp_path):
    torch.manual_seed(0)
    model, optimizer = _model_and_optimizer(seed=1)
    _train(model, optimizer, 2)
    path = Checkpointer(model, megatron_optimizer=optimizer).save(tmp_path / "step2", {"global_step": 2})
    expected_losses, expected = _train(model, optimizer, 3), _weights(model)

    torch.manual_seed(123)  # another generator state, other weights, no optimizer state yet
    other, other_optimizer = _model_and_optimizer(seed=7)
    loaded = Checkpointer(other, megatron_optimizer=other_optimizer).load(path)
    assert loaded.path == path and loaded.meta["global_step"] == 2 and not loaded.mismatch
    assert loaded.meta["megatron_lite_layout"]["world_size"] == 1 and loaded.cpu_rng_state is None
    assert _train(other, other_optimizer, 3) == expected_losses  # the same batches, masks and Adam updates
    for name, weight in _weights(other).items():
        assert torch.equal(weight, expected[name]), name
    assert set(other_optimizer.master_weights()) == set(optimizer.master_weights())


def test_a_background_save_is_a_snapshot_written_once_waited_for(tmp_path):
    torch.manual_seed(0)
    model, optimizer = _model_and_optimizer(seed=1)
    _train(model, optimizer, 1)
    checkpointer = Checkpointer(model, megatron_optimizer=optimizer)
    at_save = _weights(model)
    path = checkpointer.save(tmp_path / "async.ckpt", {"global_step": 1}, asynchronous=True)
    assert checkpointer.pending == path
    _train(model, optimizer, 1)  # training goes on while the files are written
    checkpointer.wait()
    assert checkpointer.pending is None and verify_checkpoint(path).status == "ok"
    other, other_optimizer = _model_and_optimizer(seed=7)
    Checkpointer(other, megatron_optimizer=other_optimizer).load(path, rng=False)
    for name, weight in _weights(other).items():
        assert torch.equal(weight, at_save[name]), name  # what the model held when the save was asked for

    checkpointer.save(tmp_path / "second.ckpt", {"global_step": 2}, asynchronous=True)
    checkpointer.close()  # waits for it, then ends the writer's thread
    assert verify_checkpoint(tmp_path / "second.ckpt").status == "ok"
    assert not [t for t in threading.enumerate() if t.name.startswith("megatron-lite-checkpoint")]
    assert checkpointer.pending is None


def test_a_training_save_is_its_folders_latest_and_a_writers_output_never_is(tmp_path):
    """`megatron-lite prune/quantize/convert --output runs/pruned` write with save_weights_checkpoint: loading `runs`
    (what ckpt_path=runs does) must still load the run's newest save, not the writer's output."""
    runs = tmp_path / "runs"
    module = ml.GPTModule(ml.GPTConfig(**CONFIG))
    module.configure_model()
    Checkpointer(module).save(runs / "last.ckpt", {"global_step": 5})
    save_weights_checkpoint(module, runs / "pruned")
    assert resolve_checkpoint(runs) == runs / "last.ckpt"
    assert read_checkpoint_meta(resolve_checkpoint(runs))["global_step"] == 5


@pytest.mark.parametrize("plugin", [TorchCheckpointIO, AsyncCheckpointIO])
def test_a_checkpoint_io_plugin_is_refused_with_the_fix(plugin):
    with pytest.raises(
        ValueError,
        match=rf"does not take a CheckpointIO plugin \({plugin.__name__}\).*"
        r"MegatronStrategy\(async_save=True\)",
    ):
        ml.MegatronStrategy(checkpoint_io=plugin())
    with pytest.raises(ValueError, match=rf"does not take a CheckpointIO plugin \({plugin.__name__}\)"):
        L.Trainer(strategy=ml.MegatronStrategy(), plugins=[plugin()], accelerator="cpu", devices=1, logger=False)

"""The reward model (issue 10's second objective on the engine) at TP2, TP2+SP, PP2 (also
interleaved), DP2 (also FSDP2), TP2xPP2+SP and PP2xDP2 equals one process through a real Trainer.

Same seed, same preference file, same global batch: the per-step Bradley-Terry losses, the first
step's full gradients (gathered over TP and every pipeline stage), the final parameters (rtol 1e-5)
and the logged train/accuracy, which every rank must log with the same value.
"""

import json
import random
from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import Recorder, assert_same_training, tiny_config

import megatron_lite as ml
from megatron_lite.data import PreferenceDataModule
from megatron_lite.rl import RewardModelModule
from megatron_lite.tokenizers import NullTokenizer

CONFIG = dict(num_layers=4)
STEPS = 6
LAYOUTS = {
    "tp2": dict(devices=2, tp=2),
    "tp2_sp": dict(devices=2, tp=2, sp=True),
    "pp2": dict(devices=2, pp=2),
    "pp2_vpp2": dict(devices=2, pp=2, vpp=2),
    "dp2": dict(devices=2),
    "dp2_fsdp2": dict(devices=2, strategy_kwargs=dict(use_torch_fsdp2=True)),
    "tp2_pp2_sp": dict(devices=4, tp=2, pp=2, sp=True),
    "pp2_dp2": dict(devices=4, pp=2, mbs=1),
}


class AccuracyRecorder(L.Callback):
    """Every rank writes the train/accuracy it logged at each step (they must all agree)."""

    def __init__(self, out: Path):
        self.out, self.values = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(float(trainer.callback_metrics["train/accuracy"]))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.values, self.out / f"accuracy_{trainer.global_rank}.pt")


def write_pairs(path: Path, n: int, vocab: int, seed: int = 0) -> str:
    """Random pairs of different lengths (some cut at seq_length), so last tokens fall anywhere."""
    rng = random.Random(seed)
    words = lambda k: " ".join(str(rng.randrange(vocab - 1)) for _ in range(k))  # noqa: E731
    with open(path, "w") as f:
        for _ in range(n):
            f.write(
                json.dumps(
                    {
                        "prompt": words(rng.randint(1, 12)),
                        "chosen": words(rng.randint(0, 30)),
                        "rejected": words(rng.randint(0, 30)),
                    }
                )
                + "\n"
            )
    return str(path)


def train(
    out: Path,
    data_file: str,
    *,
    devices=1,
    tp=1,
    sp=False,
    pp=1,
    vpp=1,
    steps=STEPS,
    mbs=2,
    gbs=8,
    strategy_kwargs=None,
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**CONFIG)
    data = PreferenceDataModule(
        data_file,
        NullTokenizer(config.vocab_size),
        seq_length=config.seq_length,
        micro_batch_size=mbs,
        global_batch_size=gbs,
        split="100,0",
        seed=3,
    )
    # No clipping: the recorded gradients are then the raw ones (a clipped gradient, like Adam's step, hides
    # a wrong overall scale, e.g. a gradient counted once per TP rank).
    optimizer = ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=2, lr_decay_iters=20, min_lr=1e-4, clip_grad=0.0)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
            start_method="fork",
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=vpp,
            **(strategy_kwargs or {}),
        ),
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Recorder(out), AccuracyRecorder(out)],
    )
    trainer.fit(RewardModelModule(config, optimizer=optimizer, seed=1234), data)
    result = torch.load(out / "result.pt", weights_only=False)
    result["accuracy"] = [torch.load(out / f"accuracy_{r}.pt") for r in range(devices)]
    return result


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 64, tiny_config().vocab_size)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_file):
    return train(tmp_path_factory.mktemp("single"), data_file)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_reward_model_layout_matches_single_process(name, reference, data_file, tmp_path):
    result = train(tmp_path, data_file, **LAYOUTS[name])
    assert result["global_step"] == STEPS
    assert "value_head.weight" in result["grads"] and "output_layer.weight" not in result["params"]
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["grad_norms"]), torch.tensor(reference["grad_norms"]), rtol=1e-5, atol=0
    )
    # Accuracy is a share of 8 pairs: the same on every rank and equal to one process's, exactly.
    for rank_values in result["accuracy"]:
        assert rank_values == reference["accuracy"][0]


class ValidationRecorder(L.Callback):
    """Every rank writes the val/ metrics it logged."""

    def __init__(self, out: Path):
        self.out = Path(out)

    def on_validation_end(self, trainer, pl_module):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        torch.save(metrics, self.out / f"val_{trainer.global_rank}.pt")


def validate(out: Path, data_file: str, *, devices=1, tp=1, pp=1, mbs=2) -> list[dict]:
    """val/loss and val/accuracy of the untrained model over a 16-pair split (two global batches)."""
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(**CONFIG)
    data = PreferenceDataModule(
        data_file,
        NullTokenizer(config.vocab_size),
        seq_length=config.seq_length,
        micro_batch_size=mbs,
        global_batch_size=8,
        split="48,16",
        seed=3,
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, start_method="fork"
        ),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ValidationRecorder(out)],
    )
    trainer.validate(RewardModelModule(config, seed=1234), data)
    return [torch.load(out / f"val_{r}.pt") for r in range(devices)]


def test_validation_loss_and_accuracy_match_on_every_rank(data_file, tmp_path):
    """Forward-only through the pipeline: the last stage's tally reaches every stage and DP rank."""
    reference = validate(tmp_path / "single", data_file)[0]
    assert set(reference) >= {"val/loss", "val/accuracy"} and 0 < reference["val/accuracy"] < 1
    for metrics in validate(tmp_path / "pp2_dp2", data_file, devices=4, pp=2, mbs=1):
        assert metrics["val/accuracy"] == reference["val/accuracy"]
        assert metrics["val/loss"] == pytest.approx(reference["val/loss"], rel=1e-5)

"""A reward model learns a trivially learnable preference (the chosen response is made of one token,
the rejected of the other, the prompt's last token says which is wanted) through a real Trainer:
train/accuracy rises from chance to 1, and val/accuracy and val/loss are logged and as good."""

import json
import random

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.data import PreferenceDataModule
from megatron_lite.rl import RewardModelModule
from megatron_lite.tokenizers import NullTokenizer


class Metrics(L.Callback):
    """Writes what the run logged (the ranks are forked: the test reads a file)."""

    def __init__(self, out):
        self.out, self.train = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(trainer.callback_metrics["train/accuracy"]))

    def on_train_end(self, trainer, pl_module):
        val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        torch.save({"train": self.train, "val": val}, self.out / "metrics.pt")


def test_accuracy_rises_on_a_learnable_preference(tmp_path):
    rng = random.Random(0)
    with open(tmp_path / "pairs.jsonl", "w") as f:
        for _ in range(96):
            # The prompt's last token says which response token is wanted, so that no function of the
            # response alone (e.g. the initial model's) beats chance: accuracy starts near 1/2.
            cue = rng.choice([1, 2])
            prompt = " ".join(str(rng.randrange(10, 60)) for _ in range(rng.randint(1, 6))) + f" {cue}"
            good, bad = ("5", "9") if cue == 1 else ("9", "5")
            f.write(
                json.dumps(
                    {
                        "prompt": prompt,
                        "chosen": " ".join([good] * rng.randint(1, 4)),
                        "rejected": " ".join([bad] * rng.randint(1, 4)),
                    }
                )
                + "\n"
            )
    config = ml.GPTConfig(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=64, seq_length=16)
    data = PreferenceDataModule(
        str(tmp_path / "pairs.jsonl"),
        NullTokenizer(64),
        seq_length=16,
        micro_batch_size=4,
        global_batch_size=8,
        split="80,20",
        seed=1,
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        accelerator="cpu",
        devices=1,
        max_steps=40,
        val_check_interval=40,
        check_val_every_n_epoch=None,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        callbacks=[Metrics(tmp_path)],
    )
    trainer.fit(RewardModelModule(config, optimizer=ml.OptimizerConfig(lr=1e-2, lr_decay_style="constant")), data)
    metrics = torch.load(tmp_path / "metrics.pt")
    train, val = metrics["train"], metrics["val"]
    assert len(train) == 40
    assert sum(train[:5]) / 5 < 0.6  # chance at the start
    assert train[-8:] == [1.0] * 8
    assert val["val/accuracy"] == 1.0 and val["val/loss"] < 0.2  # held-out pairs: learned, not memorised
    assert "val/perplexity" not in val  # exp of a Bradley-Terry loss is no perplexity: the metrics callback skips it

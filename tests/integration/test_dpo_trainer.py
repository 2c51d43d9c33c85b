"""DPO through a real Trainer: it learns a synthetic preference whose answer is known (held-out reward
accuracy > 90%), the reference can be one of our checkpoints (and one of another shape is refused before
launch, naming both shapes), and bad options or data fail with one clear line."""

import json
import random

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite.data import PreferenceDataModule
from megatron_lite.pretrained import save_weights_checkpoint
from megatron_lite.rl import DPOModule
from megatron_lite.tokenizers import NullTokenizer

VOCAB = 64
CONFIG = dict(num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=VOCAB, seq_length=16)


def write_cued_pairs(path, n, seed=0):
    """The prompt's last token (1 or 2) says which answer token is wanted (5 or 9): no function of the
    response alone beats chance, so the initial policy's implicit reward accuracy is near 1/2."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(n):
            cue = rng.choice([1, 2])
            prompt = " ".join(str(rng.randrange(10, 60)) for _ in range(rng.randint(1, 6))) + f" {cue}"
            good, bad = ("5", "9") if cue == 1 else ("9", "5")
            length = rng.randint(1, 4)
            f.write(
                json.dumps(
                    {"prompt": prompt, "chosen": " ".join([good] * length), "rejected": " ".join([bad] * length)}
                )
                + "\n"
            )
    return str(path)


class Metrics(L.Callback):
    def __init__(self, out):
        self.out, self.train = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.train.append(float(trainer.callback_metrics["train/reward_accuracy"]))

    def on_train_end(self, trainer, pl_module):
        val = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        torch.save({"train": self.train, "val": val}, self.out / "metrics.pt")


def _trainer(tmp_path, **kwargs):
    settings = dict(
        accelerator="cpu",
        devices=1,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
    )
    settings.update(kwargs)
    return L.Trainer(strategy=ml.MegatronStrategy(start_method="fork"), **settings)


def test_dpo_learns_a_known_preference_on_held_out_pairs(tmp_path):
    data = PreferenceDataModule(
        write_cued_pairs(tmp_path / "pairs.jsonl", 160),
        NullTokenizer(VOCAB),
        seq_length=16,
        micro_batch_size=8,
        global_batch_size=16,
        split="80,20",
        seed=1,
    )
    steps = 40
    trainer = _trainer(
        tmp_path, max_steps=steps, val_check_interval=steps, check_val_every_n_epoch=None, callbacks=[Metrics(tmp_path)]
    )
    module = DPOModule(
        ml.GPTConfig(**CONFIG),
        ml.OptimizerConfig(lr=1e-2, lr_decay_style="constant"),
        beta=0.1,
        precompute_reference_log_probs=True,
    )
    trainer.fit(module, data)
    metrics = torch.load(tmp_path / "metrics.pt")
    train, val = metrics["train"], metrics["val"]
    assert len(train) == steps
    assert min(train[-8:]) >= 0.875
    assert train[0] == 0.0  # policy == reference at the first step: every margin is 0, a tie counts as wrong
    assert val["val/reward_accuracy"] > 0.9, val  # 32 held-out pairs
    assert val["val/reward_margin"] > 0 and val["val/rewards_chosen"] > val["val/rewards_rejected"]
    assert val["val/loss"] < 0.69  # below log 2, the loss of a policy equal to its reference


class FirstLoss(L.Callback):
    def __init__(self, out):
        self.out = out

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if batch_idx == 0:
            torch.save(float(outputs["loss"]), self.out / "loss.pt")


def _small_pairs(tmp_path) -> PreferenceDataModule:
    """32 cued pairs, all for training, 8 per step."""
    return PreferenceDataModule(
        write_cued_pairs(tmp_path / "pairs.jsonl", 32),
        NullTokenizer(VOCAB),
        seq_length=16,
        micro_batch_size=4,
        global_batch_size=8,
        split="100,0",
    )


def _first_loss(tmp_path, module, data):
    _trainer(tmp_path, max_steps=1, limit_val_batches=0, callbacks=[FirstLoss(tmp_path)]).fit(module, data)
    return torch.load(tmp_path / "loss.pt")


def _saved(tmp_path, name, **overrides):
    """One of our checkpoints holding a freshly initialised GPT (``seed`` and shape overrides)."""
    seed = overrides.pop("seed", 1234)
    module = ml.GPTModule(ml.GPTConfig(**{**CONFIG, **overrides}), seed=seed)
    module.configure_model()
    return str(save_weights_checkpoint(module, tmp_path / name))


def test_reference_from_a_checkpoint_and_one_of_another_shape(tmp_path):
    data = _small_pairs(tmp_path)
    config = ml.GPTConfig(**CONFIG)
    # The policy's own initial weights as a checkpoint: policy == reference, so the first loss is log 2 ...
    same = _first_loss(tmp_path, DPOModule(config, seed=1234, reference=_saved(tmp_path, "same")), data)
    assert same == pytest.approx(0.6931471805599453, rel=1e-6)
    # ... and other weights of the same shape are really loaded: the first loss moves off log 2.
    other_weights = _saved(tmp_path, "other", seed=7)
    other = _first_loss(tmp_path, DPOModule(config, seed=1234, beta=1.0, reference=other_weights), data)
    assert abs(other - 0.6931471805599453) > 5e-3
    # from_pretrained: the policy starts from the checkpoint's weights and (reference=None) they are its reference
    pretrained = DPOModule.from_pretrained(_saved(tmp_path, "pretrained", seed=7), beta=1.0)
    assert (pretrained.beta, pretrained.hparams["beta"], pretrained.seed) == (1.0, 1.0, 7)
    assert _first_loss(tmp_path, pretrained, data) == pytest.approx(0.6931471805599453, rel=1e-6)
    wider = _saved(tmp_path, "wider", hidden_size=64)
    with pytest.raises(ValueError) as err:  # refused before any process starts, naming both shapes
        _trainer(tmp_path, max_steps=1).fit(DPOModule(config, reference=wider), data)
    message = str(err.value)
    assert "reference {'hidden_size': 64" in message and "vs policy {'hidden_size': 32" in message
    assert "\n" not in message
    qk_norms = _saved(tmp_path, "qk_norms", qk_layernorm=True)  # extra weights, none of another shape
    with pytest.raises(ValueError, match=r"reference \{'qk_layernorm': True\} vs policy \{'qk_layernorm': False\}"):
        _trainer(tmp_path, max_steps=1).fit(DPOModule(config, reference=qk_norms), data)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        _trainer(tmp_path, max_steps=1).fit(DPOModule(config, reference=str(tmp_path / "missing")), data)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(beta=0.0), "beta must be a number > 0"),
        (dict(loss_type="kto"), "loss_type must be one of"),
        (dict(loss_type="ipo", label_smoothing=0.1), "set it to 0 for IPO"),
    ],
)
def test_bad_options(kwargs, match):
    with pytest.raises(ValueError, match=match):
        DPOModule(ml.GPTConfig(**CONFIG), **kwargs)


def test_non_preference_batches_are_refused(tmp_path):
    from megatron_lite.data import MockGPTDataModule

    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=2, vocab_size=VOCAB)
    with pytest.raises(ValueError, match="DPOModule trains on preference pairs"):
        _trainer(tmp_path, max_steps=1, limit_val_batches=0).fit(DPOModule(ml.GPTConfig(**CONFIG)), data)


class Losses(L.Callback):
    def __init__(self, out):
        self.out, self.losses = out, []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.losses.append(float(outputs["loss"]))

    def on_train_end(self, trainer, pl_module):
        torch.save(self.losses, self.out / "losses.pt")


def test_resume_keeps_the_reference(tmp_path):
    """Started from pretrained weights (reference=None: those weights), saved after step 2 and resumed in a new
    module built the same way: steps 3-4 equal the uninterrupted run's, so the resumed run's reference is the
    pretrained weights again (it is taken when the model is built, before the checkpoint is restored)."""
    from lightning.pytorch.callbacks import ModelCheckpoint

    data = PreferenceDataModule(
        write_cued_pairs(tmp_path / "pairs.jsonl", 64),
        NullTokenizer(VOCAB),
        seq_length=16,
        micro_batch_size=4,
        global_batch_size=8,
        split="100,0",
    )
    weights = _saved(tmp_path, "pretrained", seed=7)
    optimizer = ml.OptimizerConfig(lr=1e-2, lr_decay_style="constant")
    full = tmp_path / "full"
    full.mkdir()
    _trainer(
        full,
        max_steps=4,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[Losses(full), ModelCheckpoint(dirpath=full / "ckpts", every_n_train_steps=2, save_top_k=-1)],
    ).fit(DPOModule.from_pretrained(weights, optimizer=optimizer, beta=0.5), data)
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    checkpoint = next(p for p in (full / "ckpts").iterdir() if "step=2" in p.name)
    _trainer(resumed, max_steps=4, limit_val_batches=0, callbacks=[Losses(resumed)]).fit(
        DPOModule.from_pretrained(weights, optimizer=optimizer, beta=0.5), data, ckpt_path=str(checkpoint)
    )
    uninterrupted, after_resume = torch.load(full / "losses.pt"), torch.load(resumed / "losses.pt")
    assert len(uninterrupted) == 4 and len(after_resume) == 2
    assert len(set(uninterrupted)) == 4  # the policy moved: a wrong reference would change steps 3-4
    torch.testing.assert_close(torch.tensor(after_resume), torch.tensor(uninterrupted[2:]), rtol=1e-6, atol=0)


@pytest.mark.slow
def test_example_script_learns(tmp_path):
    """examples/dpo.py as a user runs it (TP2 over 2 forked processes, 60 steps): its printed figures."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    repo = Path(__file__).resolve().parents[2]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    env.pop("MASTER_PORT", None)
    proc = subprocess.run(
        [sys.executable, str(repo / "examples" / "dpo.py"), "--out", str(tmp_path)],
        cwd=repo,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    accuracy = float(re.search(r"held-out \(96 pairs\): reward accuracy ([0-9.]+)", proc.stdout).group(1))
    prefer = re.search(r"policy prefers the chosen reply: ([0-9.]+) before -> ([0-9.]+) after", proc.stdout)
    assert accuracy > 0.9 and float(prefer.group(2)) > 0.9 > float(prefer.group(1)), proc.stdout


def test_a_policy_with_mtp_is_trained_on_its_main_head_only(tmp_path):
    """DPO scores sequences with the main head: a policy's multi-token prediction loss (summed over tokens, it would
    be divided by DPO's pair count) is left out and its MTP depths keep their weights, so the rest trains exactly as
    the same policy without an MTP block (every weight is drawn from the seed and its name: the same weights)."""
    data = _small_pairs(tmp_path)
    trained = {}
    for name, depth in (("plain", None), ("mtp", 1)):
        module = DPOModule(
            ml.GPTConfig(**CONFIG, mtp_num_layers=depth), ml.OptimizerConfig(lr=1e-2, lr_decay_style="constant")
        )
        module.configure_model()
        initial = {n: p.detach().clone() for n, p in module.model.named_parameters()}
        trainer = _trainer(tmp_path / name, max_steps=2, limit_val_batches=0)
        trainer.fit(module, data)
        assert "train/mtp_loss" not in trainer.callback_metrics
        trained[name] = ({n: p.detach().clone() for n, p in module.model.named_parameters()}, initial)
    (plain, plain_initial), (with_mtp, initial) = trained["plain"], trained["mtp"]
    assert any(name.startswith("mtp.") for name in with_mtp)
    assert any(not torch.equal(plain[name], plain_initial[name]) for name in plain)  # it trained
    for name, value in with_mtp.items():
        expected = initial[name] if name.startswith("mtp.") else plain[name]
        torch.testing.assert_close(value, expected, rtol=1e-6, atol=0, msg=name)

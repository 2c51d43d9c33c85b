"""GRPO through a real Trainer on the toy addition task (``a+b=`` with a character tokenizer).

- a checkpoint taken after the first rollout batch and resumed continues EXACTLY: the same prompts, the
  same sampled responses (rollout seed counter and prompt position restored), the same rewards and weights;
- the frozen reference model is checkpointed with the policy (beta > 0) and pass@k runs on held-out prompts;
- a reward function that raises stops the run with an error naming the function and the sample;
- GRPO raises the mean reward from <= 0.2 to >= 0.8 from a random tiny model.
"""

import dataclasses

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite.data import RLPromptDataModule
from megatron_lite.rl import GRPOConfig, GRPOModule
from megatron_lite.rl.rewards import RegexReward, WeightedRewards, exact_match
from megatron_lite.rl.tasks import AdditionTask


class Rewards(L.Callback):
    """The rollout metrics of every training step."""

    def __init__(self):
        self.rows = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        m = trainer.callback_metrics
        self.rows.append(
            {k: float(m[k]) for k in ("train/reward_mean", "train/nonzero_groups_ratio", "train/kl", "train/loss")}
        )


def _setup(max_operand=3, held_out=4, gbs=4, mbs=2, grpo=None, lr=3e-3, hidden=64, layers=2, reward=None):
    task = AdditionTask(max_operand=max_operand, seed=0)
    train, held = task.split(held_out)
    tok = task.tokenizer
    config = ml.GPTConfig(
        num_layers=layers,
        hidden_size=hidden,
        num_attention_heads=4,
        vocab_size=tok.vocab_size,
        seq_length=8,
        make_vocab_size_divisible_by=8,
    )
    data = RLPromptDataModule(tok, rows=train, val_rows=held, seq_length=8, micro_batch_size=mbs, global_batch_size=gbs)
    grpo = grpo or GRPOConfig(group_size=8, max_new_tokens=1)
    optimizer = ml.OptimizerConfig(lr=lr, lr_decay_style="constant", clip_grad=1.0, weight_decay=0.0)
    return GRPOModule(config, optimizer, seed=7, grpo=grpo, reward_fn=reward or task.reward), data


def _fit(module, data, steps, tmp_path, ckpt_path=None, checkpoint_every=None, val=False):
    rewards = Rewards()
    callbacks = [rewards]
    if checkpoint_every:
        callbacks.append(
            L.pytorch.callbacks.ModelCheckpoint(
                dirpath=tmp_path / "ckpt", every_n_train_steps=checkpoint_every, save_top_k=-1
            )
        )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        enable_checkpointing=bool(checkpoint_every),
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=1 if val else 0,
        num_sanity_val_steps=0,
        val_check_interval=2 if val else None,
        check_val_every_n_epoch=None if val else 1,
        callbacks=callbacks,
    )
    trainer.fit(module, data, ckpt_path=ckpt_path)
    return trainer, rewards.rows


def _params(module):
    return {k: v.detach().clone() for k, v in module.state_dict().items()}


def test_resume_continues_exactly_with_the_reference_and_pass_at_k(tmp_path):
    grpo = GRPOConfig(group_size=4, max_new_tokens=2, updates_per_batch=2, beta=0.05, eval_samples=3)
    # Partial credit for a one-digit answer, so that most groups carry a signal.
    reward = WeightedRewards({exact_match: 1.0, RegexReward(r"\d"): 0.5})
    straight, data = _setup(grpo=grpo, reward=reward)
    trainer, rows = _fit(straight, data, 4, tmp_path / "a", val=True)
    assert len(rows) == 2 and all(r["train/nonzero_groups_ratio"] > 0 for r in rows)
    assert rows[1]["train/kl"] > 0  # the policy has moved away from the frozen reference
    assert 0.0 <= float(trainer.callback_metrics["val/pass_at_k"]) <= 1.0
    assert "val/reward_mean" in trainer.callback_metrics

    first, data = _setup(grpo=grpo, reward=reward)
    _fit(first, data, 2, tmp_path / "b", checkpoint_every=2)
    ckpt = next(p for p in (tmp_path / "b" / "ckpt").iterdir() if p.is_dir())
    resumed, data = _setup(grpo=grpo, reward=reward)
    _, resumed_rows = _fit(resumed, data, 4, tmp_path / "c", ckpt_path=str(ckpt))
    assert resumed.rollout_step == straight.rollout_step == 2
    assert resumed_rows == rows[1:]  # the same second rollout: prompts, samples, rewards, KL and loss
    a, b = _params(straight), _params(resumed)
    assert any(k.startswith("reference_model.") for k in a) and a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(b[name], a[name], rtol=1e-6, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_a_failing_reward_function_names_itself_and_the_sample(tmp_path):
    def broken_reward(sample):
        raise KeyError("no such field")

    module, data = _setup(reward=broken_reward)
    with pytest.raises(
        ValueError,
        match=r"reward function .*broken_reward on sample \(prompt='\d\+\d=', "
        r"completion=.*raised KeyError",
    ):
        _fit(module, data, 1, tmp_path)


def test_grpo_learns_addition_from_a_random_model(tmp_path):
    """Seeded: a random 2-layer model answers ~1/16 of ``a+b=`` (a, b <= 3) right; 40 GRPO rollouts of 8
    prompts x 8 samples bring the sampled mean reward to >= 0.8."""
    module, data = _setup(
        max_operand=3, held_out=4, gbs=8, mbs=4, lr=3e-3, grpo=GRPOConfig(group_size=8, max_new_tokens=1)
    )
    _, rows = _fit(module, data, 40, tmp_path)
    rewards = [r["train/reward_mean"] for r in rows]
    assert rewards[0] <= 0.2, rewards
    assert sum(rewards[-3:]) / 3 >= 0.8, rewards


def test_a_policy_with_mtp_freezes_its_mtp_depths():
    """GRPO's log-probs come from the main head's logits: a policy's MTP depths get no loss, and are frozen, so the
    optimizer leaves them out (without it, weight decay moved them: seen in a one-step fit); the rest trains."""
    module, _ = _setup()
    module = GRPOModule(
        dataclasses.replace(module.config, mtp_num_layers=1), module.optimizer_config, seed=7, grpo=module.grpo
    )
    module.configure_model()
    trainable = {name: p.requires_grad for name, p in module.model.named_parameters()}
    assert any(name.startswith("mtp.") for name in trainable)
    assert all(requires_grad != name.startswith("mtp.") for name, requires_grad in trainable.items())

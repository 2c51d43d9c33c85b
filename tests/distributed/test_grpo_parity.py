"""A GRPO update on FIXED rollouts at TP2, DP2 and PP2 equals one process, through a real Trainer.

The rollouts (prompt + response rows, response masks, advantages, sampler log-probs) are fixed data, so the
layouts differ only in how the update is computed: old and reference log-probs recomputed by the trainer,
the truncated IS weights, the clipped surrogate with k3 KL and the entropy bonus (vocab-parallel under TP),
token-level normalization over the global batch (DP), two updates per rollout batch. Compared: every
update's loss, the first update's full gradients, the final parameters (rtol 1e-5) and the logged KL,
entropy and clip fractions, which every rank must log with the same value.

Then two WHOLE GRPO steps (sampling from the current weights, scoring, update) at DP2 and TP2 equal one
process: the same rewards (so the same sampled tokens) on every rank, the same updates.
"""

from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import Recorder, assert_same_training, tiny_config
from torch.utils.data import Dataset

import megatron_lite as ml
from megatron_lite.data import PretrainingDataModule
from megatron_lite.rl import GRPOConfig, GRPOModule

STEPS = 4  # optimizer steps: 2 rollout batches x 2 updates each
MOE = dict(num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=64, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)
METRICS = ("train/kl", "train/entropy", "train/clip_fraction_low", "train/clip_fraction_high")


class FixedRollouts(Dataset):
    """Seeded rollout rows: a prompt of 2..8 tokens, a response of 1..12, group advantages, noisy sampler log-probs."""

    def __init__(self, n: int, seq_length: int, vocab: int, group_size: int = 4):
        g = torch.Generator().manual_seed(11)
        self.items = []
        rewards = torch.randint(0, 3, (n,), generator=g).double()
        rewards[:group_size] = 1.0  # one zero-variance group
        from megatron_lite.rl.grpo_loss import group_advantages

        advantages = group_advantages(rewards, group_size)
        for i in range(n):
            prompt = int(torch.randint(2, 9, (), generator=g))
            response = int(torch.randint(1, 13, (), generator=g))
            tokens = torch.full((seq_length + 1,), vocab - 1, dtype=torch.int64)
            tokens[: prompt + response] = torch.randint(0, vocab - 1, (prompt + response,), generator=g)
            mask = torch.zeros(seq_length)
            mask[prompt - 1 : prompt - 1 + response] = 1.0
            sampler = (-torch.rand(seq_length, generator=g) * 8.0) * mask
            self.items.append(
                {"tokens": tokens, "loss_mask": mask, "advantages": advantages[i], "sampler_log_probs": sampler}
            )

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        return self.items[i]


class RolloutData(PretrainingDataModule):
    def __init__(self, config, mbs=2, gbs=8):
        super().__init__(config.seq_length, mbs, gbs, num_workers=0)
        self.dataset = FixedRollouts(16, config.seq_length, config.vocab_size)

    def train_dataloader(self):
        return self._loader(self.dataset, "train", self._consumed_at_start())


class MetricRecorder(L.Callback):
    def __init__(self, out: Path):
        self.out, self.values = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append([float(trainer.callback_metrics[k]) for k in METRICS])

    def on_train_end(self, trainer, pl_module):
        torch.save(self.values, self.out / f"metrics_{trainer.global_rank}.pt")


def train(out: Path, *, devices=1, tp=1, pp=1) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(num_layers=2)
    grpo = GRPOConfig(
        group_size=4,
        beta=0.1,
        entropy_coef=0.01,
        updates_per_batch=2,
        clip_eps_low=0.2,
        clip_eps_high=0.28,
        is_correction_cap=2.0,
    )
    optimizer = ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant", clip_grad=0.0)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp, start_method="fork"
        ),
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Recorder(out), MetricRecorder(out)],
    )
    trainer.fit(GRPOModule(config, optimizer, seed=1234, grpo=grpo), RolloutData(config))
    result = torch.load(out / "result.pt", weights_only=False)
    result["metrics"] = [torch.load(out / f"metrics_{r}.pt") for r in range(devices)]
    return result


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    return train(tmp_path_factory.mktemp("single"))


@pytest.mark.parametrize(
    "name,layout", [("tp2", dict(devices=2, tp=2)), ("dp2", dict(devices=2)), ("pp2", dict(devices=2, pp=2))]
)
def test_grpo_update_on_fixed_rollouts_matches_one_process(name, layout, reference, tmp_path):
    result = train(tmp_path, **layout)
    assert result["global_step"] == STEPS and len(result["losses"]) == STEPS // 2
    assert_same_training(result, reference)
    ref_metrics = torch.tensor(reference["metrics"][0])
    assert ref_metrics[:, 0].max() > 0 and ref_metrics[:, 1].min() > 0  # KL and entropy were computed
    assert ref_metrics[1:, 2:].sum() > 0  # the second update of a batch clips some tokens
    for rank_metrics in result["metrics"]:
        torch.testing.assert_close(torch.tensor(rank_metrics), ref_metrics, rtol=1e-5, atol=1e-7)


class RewardRecorder(L.Callback):
    def __init__(self, out: Path):
        self.out, self.values = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append(
            [
                float(trainer.callback_metrics[k])
                for k in ("train/reward_mean", "train/reward_std", "train/nonzero_groups_ratio")
            ]
        )

    def on_train_end(self, trainer, pl_module):
        torch.save(self.values, self.out / f"rewards_{trainer.global_rank}.pt")


def full_step(out: Path, devices: int, tp: int = 1, ep: int = 1, moe: bool = False, beta: float = 0.0) -> dict:
    """Two whole GRPO steps (sampling, scoring, update) on the addition task (``moe``: a mixture-of-experts
    policy, its experts split over ``ep`` ranks, and every fourth prompt a longer one, ``0+a+b=``)."""
    from megatron_lite.data import RLPromptDataModule
    from megatron_lite.rl.tasks import AdditionTask

    out.mkdir(parents=True, exist_ok=True)
    task = AdditionTask(max_operand=3, seed=0)
    rows = [dict(row, prompt="0+" + row["prompt"]) if moe and i % 4 == 0 else row for i, row in enumerate(task.rows)]
    config = ml.GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        vocab_size=task.tokenizer.vocab_size,
        seq_length=8,
        make_vocab_size_divisible_by=8,
        **(MOE if moe else {}),
    )
    data = RLPromptDataModule(task.tokenizer, rows=rows, seq_length=8, micro_batch_size=2, global_batch_size=8)
    # lr 1e-3: the loss is ~0 and Adam turns near-zero gradients summed in another order into ~lr steps
    # (see assert_same_params), so the tolerance on the parameters scales with lr.
    module = GRPOModule(
        config,
        ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant", clip_grad=0.0),
        seed=7,
        grpo=GRPOConfig(group_size=4, max_new_tokens=2, beta=beta),
        reward_fn=task.reward,
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, start_method="fork"),
        accelerator="cpu",
        devices=devices,
        max_steps=2,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Recorder(out), RewardRecorder(out)] + ([MoERecorder(out)] if moe else []),
    )
    trainer.fit(module, data)
    result = torch.load(out / "result.pt", weights_only=False)
    result["rewards"] = [torch.load(out / f"rewards_{r}.pt") for r in range(devices)]
    if moe:
        result["moe"] = [torch.load(out / f"moe_{r}.pt") for r in range(devices)]
    return result


class MoERecorder(L.Callback):
    """The policy's MoE metrics logged at each step, and what the frozen reference's MoE layers left recorded."""

    def __init__(self, out: Path):
        self.out, self.values = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append([float(trainer.callback_metrics[k]) for k in ("train/load_balancing_loss", "train/z_loss")])

    def on_train_end(self, trainer, pl_module):
        leaked = pl_module.reference_model.take_step_report()
        torch.save({"metrics": self.values, "reference_report": leaked}, self.out / f"moe_{trainer.global_rank}.pt")


def test_whole_grpo_steps_at_dp2_and_tp2_match_one_process(tmp_path):
    """Sampling included: each prompt's samples are seeded by its dataset index and the rollout number, so two
    DP ranks holding half the prompts each draw exactly the samples one process draws; TP2 ranks sample from
    the same full-vocabulary logits."""
    single = full_step(tmp_path / "single", 1)
    assert single["rewards"][0][0][2] > 0  # some groups carried signal
    for name, tp in (("dp2", 1), ("tp2", 2)):
        result = full_step(tmp_path / name, 2, tp)
        for rank_rewards in result["rewards"]:
            torch.testing.assert_close(
                torch.tensor(rank_rewards), torch.tensor(single["rewards"][0]), rtol=1e-6, atol=0
            )
        # With short answers a group's advantages nearly cancel and the loss is ~1e-8: compare it absolutely.
        torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]), rtol=0, atol=1e-6)
        assert_same_training(dict(result, losses=single["losses"]), single)


def test_whole_grpo_steps_of_an_moe_policy_at_ep2_match_one_process(tmp_path):
    """The experts split over the two data-parallel replicas: each samples its own prompts, of other lengths than
    the other replica's (so the replicas send the experts different numbers of tokens), then the update, whose
    router losses are the policy's alone: the frozen reference (beta > 0, the same layout) runs forward only and
    records none."""
    single = full_step(tmp_path / "single", 1, moe=True, beta=0.1)
    result = full_step(tmp_path / "ep2", 2, ep=2, moe=True, beta=0.1)
    assert single["rewards"][0][0][2] > 0  # some groups carried signal
    for rank_rewards in result["rewards"]:
        torch.testing.assert_close(torch.tensor(rank_rewards), torch.tensor(single["rewards"][0]), rtol=1e-6, atol=0)
    torch.testing.assert_close(torch.tensor(result["losses"]), torch.tensor(single["losses"]), rtol=0, atol=1e-6)
    assert_same_training(dict(result, losses=single["losses"]), single)
    expected = torch.tensor(single["moe"][0]["metrics"])
    assert expected.min() > 0  # the load-balancing and z losses were recorded and logged
    for rank in result["moe"] + single["moe"]:
        torch.testing.assert_close(torch.tensor(rank["metrics"]), expected, rtol=1e-5, atol=0)
        assert rank["reference_report"] == {}

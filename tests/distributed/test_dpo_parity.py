"""DPO (issue 16) at TP2, TP2+SP, PP2, DP2 and CP2 equals one process through a real Trainer (ranks forked).

Same seed, same preference file, same global batch: the per-step DPO losses, the first step's full
gradients (gathered over TP and every pipeline stage), the final parameters (rtol 1e-5), and the logged
train/rewards_chosen, rewards_rejected, reward_margin and reward_accuracy, which every rank must log with
the same values. The frozen reference runs in the same layout as the policy (its own forward-only
pipeline under PP, its partial log-probs summed over CP); the precomputed variant (reference run once
before training, then freed) must give the same run as the live one. Validation at PP2xDP2 with a reference
loaded from another checkpoint logs one process's val/ metrics on every rank.
"""

from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import Recorder, assert_same_training, tiny_config
from test_reward_model_parity import write_pairs

import megatron_lite as ml
from megatron_lite.data import PreferenceDataModule
from megatron_lite.rl import DPOModule
from megatron_lite.tokenizers import NullTokenizer

STEPS = 3
METRICS = ("train/rewards_chosen", "train/rewards_rejected", "train/reward_margin", "train/reward_accuracy")
LAYOUTS = {
    "tp2": dict(devices=2, tp=2),
    "tp2_sp": dict(devices=2, tp=2, sp=True),
    "pp2": dict(devices=2, pp=2),
    "dp2": dict(devices=2),
    "cp2": dict(devices=2, cp=2),
    "pp2_precomputed": dict(devices=2, pp=2, precompute=True),
}


class RewardRecorder(L.Callback):
    """Every rank writes the DPO metrics it logged at each step (they must all agree)."""

    def __init__(self, out: Path):
        self.out, self.values = Path(out), []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.values.append([float(trainer.callback_metrics[m]) for m in METRICS])

    def on_train_end(self, trainer, pl_module):
        torch.save(self.values, self.out / f"rewards_{trainer.global_rank}.pt")


def train(
    out: Path, data_file: str, *, devices=1, tp=1, sp=False, pp=1, cp=1, ep=1, precompute=False, config=None
) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = config or tiny_config()
    data = PreferenceDataModule(
        data_file,
        NullTokenizer(config.vocab_size),
        seq_length=config.seq_length,
        micro_batch_size=2,
        global_batch_size=8,
        split="100,0",
        seed=3,
    )
    # No clipping: the recorded gradients are the raw ones. The first step moves the policy away from its
    # reference at once, so later losses and rewards depend on both models.
    optimizer = ml.OptimizerConfig(optimizer="sgd", lr=0.3, lr_decay_style="constant", clip_grad=0.0)
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            expert_model_parallel_size=ep,
            start_method="fork",
        ),
        accelerator="cpu",
        devices=devices,
        max_steps=STEPS,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[Recorder(out), RewardRecorder(out)],
    )
    trainer.fit(
        DPOModule(
            config,
            optimizer=optimizer,
            seed=1234,
            beta=0.5,
            label_smoothing=0.1,
            precompute_reference_log_probs=precompute,
        ),
        data,
    )
    result = torch.load(out / "result.pt", weights_only=False)
    result["rewards"] = [torch.load(out / f"rewards_{r}.pt") for r in range(devices)]
    return result


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 32, tiny_config().vocab_size)


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data_file):
    return train(tmp_path_factory.mktemp("single"), data_file)


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_dpo_layout_matches_single_process(name, reference, data_file, tmp_path):
    result = train(tmp_path, data_file, **LAYOUTS[name])
    assert result["global_step"] == STEPS
    losses = reference["losses"]
    assert losses[0] == pytest.approx(0.6931471805599453, rel=1e-6)  # h = 0: policy == reference at step 0
    assert len(set(losses)) == STEPS  # the policy moved away from its reference: later losses differ
    assert_same_training(result, reference)
    expected = torch.tensor(reference["rewards"][0])
    assert expected[1:, 2].abs().min() > 0  # nonzero margins after the first step
    for rank_values in result["rewards"]:  # every rank logs the global batch's values
        assert rank_values == result["rewards"][0]
    got = torch.tensor(result["rewards"][0])
    assert torch.equal(got[:, 3], expected[:, 3])  # accuracy: a share of 8 pairs, exactly one process's
    # A reward is beta x (log pi - log pi_ref), a difference of two sums of ~30 log-probs of ~ -7 each: the
    # per-token log-probs' fp32 rounding (summed in another order under TP and CP) leaves ~1e-6 absolute in it,
    # so the rewards are compared at 1e-5 of the log-prob sums' scale, not of their small difference.
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_dpo_with_an_moe_policy_at_ep2_matches_single_process(data_file, tmp_path):
    """The policy and its frozen reference are MoE models with their experts split over 2 ranks (the reference's
    forward-only MoE layers record nothing and add no auxiliary loss): losses, gradients, parameters and the
    logged rewards equal one process's."""
    config = tiny_config(num_moe_experts=4, moe_router_topk=2, ffn_hidden_size=64, moe_aux_loss_coeff=1e-2)
    reference = train(tmp_path / "single", data_file, config=config)
    result = train(tmp_path / "ep2", data_file, devices=2, ep=2, config=config)
    assert len(set(reference["losses"])) == STEPS
    assert_same_training(result, reference)
    torch.testing.assert_close(
        torch.tensor(result["rewards"][0]), torch.tensor(reference["rewards"][0]), rtol=1e-5, atol=1e-5
    )


class ValidationRecorder(L.Callback):
    """Every rank writes the val/ metrics it logged."""

    def __init__(self, out: Path):
        self.out = Path(out)

    def on_validation_end(self, trainer, pl_module):
        metrics = {k: float(v) for k, v in trainer.callback_metrics.items() if k.startswith("val/")}
        torch.save(metrics, self.out / f"val_{trainer.global_rank}.pt")


def validate(out: Path, data_file: str, reference: str, *, devices=1, pp=1, mbs=2) -> list[dict]:
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    data = PreferenceDataModule(
        data_file,
        NullTokenizer(config.vocab_size),
        seq_length=config.seq_length,
        micro_batch_size=mbs,
        global_batch_size=8,
        split="16,16",
        seed=3,
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(pipeline_model_parallel_size=pp, start_method="fork"),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        callbacks=[ValidationRecorder(out)],
    )
    trainer.validate(DPOModule(config, seed=1234, beta=0.5, reference=reference), data)
    return [torch.load(out / f"val_{r}.pt") for r in range(devices)]


def test_validation_with_a_checkpoint_reference_at_pp2_dp2(data_file, tmp_path):
    """Forward only through the policy's and the reference's pipelines (the reference another model, loaded
    from one of our checkpoints and cut into this layout's stages): the val/ metrics reach every rank and
    equal one process's."""
    from megatron_lite.pretrained import save_weights_checkpoint

    other = ml.GPTModule(tiny_config(), seed=99)
    other.configure_model()
    checkpoint = str(save_weights_checkpoint(other, tmp_path / "reference"))
    expected = validate(tmp_path / "single", data_file, checkpoint)[0]
    assert {f"val/{m.split('/')[1]}" for m in METRICS} <= set(expected)
    assert abs(expected["val/reward_margin"]) > 1e-3  # the reference is not the policy
    for metrics in validate(tmp_path / "pp2_dp2", data_file, checkpoint, devices=4, pp=2, mbs=1):
        for name, value in expected.items():
            assert metrics[name] == pytest.approx(value, rel=1e-5, abs=1e-6), name

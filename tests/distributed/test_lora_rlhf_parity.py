"""DPO and GRPO with LoRA take the policy's own base, adapters switched off, as their frozen reference: no second
model is built, and the run is the two-model run's, through a real Trainer (ranks forked).

At one process the base-as-reference run equals, to the last bit, the run whose reference is an explicit frozen copy
of the base (DPO: a reference checkpoint of the base's weights, loaded as a second model; GRPO with beta > 0 on fixed
rollouts: a frozen copy of the base built beside the policy): losses, the first step's adapter gradients, the final
adapters and the logged rewards / KL. The base-as-reference run at PP2 (DPO: the reference's log-probs through the
policy's own forward-only pipeline, broadcast from the last stage), CP2 (DPO: each rank's share of the sequences,
the partial log-probs summed) and TP2 (GRPO) equals one process; DPO's reference
log-probs precomputed before training (adapters off) give the live run. Each rank built one model (the policy) and
holds no reference model.
"""

from pathlib import Path

import lightning as L
import pytest
import torch
from parity_utils import PEAK_TFLOPS, Recorder, assert_same_training, tiny_config
from test_dpo_parity import RewardRecorder
from test_grpo_parity import MetricRecorder, RolloutData
from test_reward_model_parity import write_pairs

import megatron_lite as ml
from megatron_lite.callbacks import LoRA, MegatronMetrics
from megatron_lite.core.peft import is_adapter_parameter
from megatron_lite.core.peft.lora import LORA_RECIPE
from megatron_lite.data import PreferenceDataModule
from megatron_lite.rl import DPOModule, GRPOConfig, GRPOModule
from megatron_lite.tokenizers import NullTokenizer

DPO_STEPS, GRPO_STEPS = 3, 4
TARGETS = ["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]


class Counted:
    """Counts the models the module builds (the policy; a two-model run also its reference)."""

    built = 0

    def build_model(self, layout):
        self.built += 1
        return super().build_model(layout)


class CountedDPO(Counted, DPOModule):
    pass


class CountedGRPO(Counted, GRPOModule):
    pass


class FrozenCopyGRPO(CountedGRPO):
    """The two-model run: GRPO's reference an explicit frozen copy of the policy's base, built beside it."""

    def configure_model(self) -> None:
        super().configure_model()
        if self.reference_model is None:
            copy = self.build_model(self.parallel_layout)
            base = {
                k: v for k, v in self.model.state_dict().items() if not is_adapter_parameter(k) and k != LORA_RECIPE
            }
            copy.load_state_dict(base)
            self.reference_model = copy.requires_grad_(False).eval()


class ReferenceProbe(L.Callback):
    """Every rank writes how many models its module built and whether it holds a reference model."""

    def __init__(self, out: Path):
        self.out = Path(out)

    def on_train_end(self, trainer, pl_module):
        probe = {"built": pl_module.built, "holds_reference": pl_module.reference_model is not None}
        torch.save(probe, self.out / f"probe_{trainer.global_rank}.pt")


def _trainer(out: Path, steps: int, devices: int, tp: int, pp: int, callbacks: list, cp: int = 1) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(
            tensor_model_parallel_size=tp,
            pipeline_model_parallel_size=pp,
            context_parallel_size=cp,
            start_method="fork",
        ),
        accelerator="cpu",
        devices=devices,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[
            LoRA(dim=4, alpha=8, target_modules=TARGETS),
            Recorder(out),
            ReferenceProbe(out),
            MegatronMetrics(peak_tflops_per_device=PEAK_TFLOPS),
            *callbacks,
        ],
    )


def _results(out: Path, devices: int, recorded: str) -> dict:
    result = torch.load(out / "result.pt", weights_only=False)
    result[recorded] = [torch.load(out / f"{recorded}_{r}.pt") for r in range(devices)]
    result["probes"] = [torch.load(out / f"probe_{r}.pt") for r in range(devices)]
    return result


# --- DPO ---------------------------------------------------------------------------------------------------------
def dpo(out: Path, data_file: str, *, devices=1, tp=1, pp=1, cp=1, reference=None, precompute=False) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config()
    data = PreferenceDataModule(
        data_file,
        NullTokenizer(config.vocab_size),
        seq_length=config.seq_length,
        micro_batch_size=2,
        global_batch_size=8,
        split="100,0",
        seed=3,
    )
    # SGD at a high LR: the adapters (B starts at zero) move the policy off its reference in the first step
    optimizer = ml.OptimizerConfig(optimizer="sgd", lr=0.3, lr_decay_style="constant", clip_grad=0.0)
    module = CountedDPO(
        config,
        optimizer=optimizer,
        seed=1234,
        beta=0.5,
        label_smoothing=0.1,
        reference=reference,
        precompute_reference_log_probs=precompute,
    )
    _trainer(out, DPO_STEPS, devices, tp, pp, [RewardRecorder(out)], cp=cp).fit(module, data)
    return _results(out, devices, "rewards")


@pytest.fixture(scope="module")
def data_file(tmp_path_factory):
    return write_pairs(tmp_path_factory.mktemp("pairs") / "pairs.jsonl", 32, tiny_config().vocab_size)


@pytest.fixture(scope="module")
def dpo_single(tmp_path_factory, data_file):
    return dpo(tmp_path_factory.mktemp("dpo_single"), data_file)


def test_dpo_with_lora_uses_the_base_as_reference_and_equals_the_two_model_run(dpo_single, data_file, tmp_path):
    from megatron_lite.pretrained import save_weights_checkpoint

    base = ml.GPTModule(tiny_config(), seed=1234)  # the policy's base weights (drawn from the same seed)
    base.configure_model()
    two_models = dpo(tmp_path / "two", data_file, reference=str(save_weights_checkpoint(base, tmp_path / "base")))
    assert two_models["probes"] == [{"built": 2, "holds_reference": True}]
    assert dpo_single["probes"] == [{"built": 1, "holds_reference": False}]  # no second model
    losses = dpo_single["losses"]
    assert losses[0] == pytest.approx(0.6931471805599453, rel=1e-6)  # B = 0: the policy is its reference at step 0
    assert len(set(losses)) == DPO_STEPS  # the adapters moved the policy off its reference
    assert set(dpo_single["grads"]) == {n for n in dpo_single["params"] if ".adapter." in n}  # only adapters train
    rewards = torch.tensor(dpo_single["rewards"][0])
    assert rewards[1:, 2].abs().min() > 0  # nonzero margins after the first step
    assert_same_training(dpo_single, two_models, rtol=0)  # the same numbers
    assert torch.equal(rewards, torch.tensor(two_models["rewards"][0]))


@pytest.mark.parametrize("layout", [dict(pp=2), dict(cp=2)], ids=["pp2", "cp2"])
def test_dpo_with_lora_at_pp2_and_cp2_equals_one_process(dpo_single, data_file, tmp_path, layout):
    result = dpo(tmp_path, data_file, devices=2, **layout)
    assert result["probes"] == [{"built": 1, "holds_reference": False}] * 2
    assert_same_training(result, dpo_single)
    expected = torch.tensor(dpo_single["rewards"][0])
    for rank_values in result["rewards"]:  # every rank logs the global batch's values
        torch.testing.assert_close(torch.tensor(rank_values), expected, rtol=1e-5, atol=1e-5)


def test_dpo_with_lora_precomputed_reference_equals_the_live_one(dpo_single, data_file, tmp_path):
    """The base's log-probs computed once before training (adapters off) give the live run."""
    result = dpo(tmp_path, data_file, precompute=True)
    assert result["probes"] == [{"built": 1, "holds_reference": False}]
    assert_same_training(result, dpo_single, rtol=0)
    assert torch.equal(torch.tensor(result["rewards"][0]), torch.tensor(dpo_single["rewards"][0]))


# --- GRPO --------------------------------------------------------------------------------------------------------
def grpo(out: Path, *, devices=1, tp=1, pp=1, module_class=CountedGRPO) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    config = tiny_config(num_layers=2)
    settings = GRPOConfig(group_size=4, beta=0.1, entropy_coef=0.01, updates_per_batch=2, is_correction_cap=2.0)
    optimizer = ml.OptimizerConfig(lr=2e-2, lr_decay_style="constant", clip_grad=0.0)
    module = module_class(config, optimizer, seed=1234, grpo=settings)
    _trainer(out, GRPO_STEPS, devices, tp, pp, [MetricRecorder(out)]).fit(module, RolloutData(config))
    return _results(out, devices, "metrics")


@pytest.fixture(scope="module")
def grpo_single(tmp_path_factory):
    return grpo(tmp_path_factory.mktemp("grpo_single"))


def test_grpo_with_lora_uses_the_base_as_reference_and_equals_the_two_model_run(grpo_single, tmp_path):
    two_models = grpo(tmp_path, module_class=FrozenCopyGRPO)
    assert two_models["probes"] == [{"built": 2, "holds_reference": True}]
    assert grpo_single["probes"] == [{"built": 1, "holds_reference": False}]  # no second model
    assert set(grpo_single["grads"]) == {n for n in grpo_single["params"] if ".adapter." in n}
    assert torch.tensor(grpo_single["metrics"][0])[:, 0].min() > 0  # the adapters moved the policy off its reference
    assert_same_training(grpo_single, two_models, rtol=0)  # the same numbers
    assert torch.equal(torch.tensor(grpo_single["metrics"][0]), torch.tensor(two_models["metrics"][0]))


def test_grpo_with_lora_at_tp2_equals_one_process(grpo_single, tmp_path):
    result = grpo(tmp_path, devices=2, tp=2)
    assert result["probes"] == [{"built": 1, "holds_reference": False}] * 2
    assert_same_training(result, grpo_single)
    for rank_metrics in result["metrics"]:
        torch.testing.assert_close(
            torch.tensor(rank_metrics), torch.tensor(grpo_single["metrics"][0]), rtol=1e-5, atol=1e-7
        )

"""Precisions through a real Trainer: fp16 with Megatron's dynamic loss scaler (skipped steps,
back-off, hysteresis), half-precision weights with fp32 masters, and the errors for bad choices.

fp16 matrix products are emulated on these CPUs, so the models here are tiny.
"""

import lightning as L
import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.optim.grad_scaler import DynamicLossScaler
from megatron_lite.data import MockGPTDataModule

CONFIG = dict(
    num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=256, seq_length=16, make_vocab_size_divisible_by=32
)


class InjectInf(ml.GPTModule):
    """Makes the gradients of the chosen steps non-finite (an inf loss), like an fp16 overflow."""

    def __init__(self, *args, inf_steps=(), **kwargs):
        super().__init__(*args, **kwargs)
        self.inf_steps = set(inf_steps)

    def loss_fn(self, model, microbatch):
        loss, tokens = super().loss_fn(model, microbatch)
        if self.trainer.global_step in self.inf_steps:
            loss = loss * float("inf")
        return loss, tokens


class Snapshots(L.Callback):
    """Per step: fp32 masters, loss scale and skipped count after the step, and the optimizer's step count."""

    def __init__(self, out):
        self.out = out
        self.masters, self.scales, self.skipped, self.adam_steps, self.params = [], [], [], [], []

    def _record(self, pl_module):
        mopt = pl_module.megatron_optimizer
        self.masters.append({n: m.clone() for n, m in mopt.masters.items()})
        self.params.append({n: p.detach().clone() for n, p in pl_module.model.named_parameters()})
        self.scales.append(mopt.loss_scale)
        self.skipped.append(mopt.skipped_steps)
        states = [s for s in mopt.optimizer.state.values() if "step" in s]
        self.adam_steps.append(int(states[0]["step"]) if states else 0)

    def on_train_start(self, trainer, pl_module):
        self._record(pl_module)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self._record(pl_module)

    def on_train_end(self, trainer, pl_module):  # the rank runs in a forked process: hand the record back
        torch.save(vars(self) | {"out": None}, self.out)

    @classmethod
    def load(cls, out):
        snapshots = cls(out)
        vars(snapshots).update(torch.load(out, weights_only=False) | {"out": out})
        return snapshots


def fit(module, steps, precision, tmp_path, **trainer_kwargs):
    tmp_path.mkdir(parents=True, exist_ok=True)
    snapshots = Snapshots(tmp_path / "snapshots.pt")
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork"),
        devices=1,
        accelerator="cpu",
        precision=precision,
        max_steps=steps,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[snapshots],
        default_root_dir=tmp_path,
        **trainer_kwargs,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256, seed=3)
    trainer.fit(module, data)
    return Snapshots.load(snapshots.out)


def fp16_optimizer(**kwargs):
    return ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant", initial_loss_scale=2.0**8, **kwargs)


@pytest.mark.filterwarnings("ignore:precision='16-true' on CPU")
def test_an_inf_gradient_skips_exactly_that_step_and_halves_the_scale(tmp_path):
    module = InjectInf(ml.GPTConfig(**CONFIG), fp16_optimizer(hysteresis=1), inf_steps={2})
    s = fit(module, 5, "16-true", tmp_path)
    # index i = state after i steps; step 2 (the third) is the injected one
    assert s.skipped == [0, 0, 0, 1, 1, 1]
    assert s.scales == [256.0, 256.0, 256.0, 128.0, 128.0, 128.0]
    for name in s.masters[2]:
        assert torch.equal(s.masters[3][name], s.masters[2][name]), f"{name}: master moved on the skipped step"
        assert not torch.equal(s.masters[4][name], s.masters[3][name]) or "bias" in name
    for name in s.params[2]:
        assert torch.equal(s.params[3][name], s.params[2][name]), f"{name}: fp16 weight moved on the skipped step"
    assert s.adam_steps == [0, 1, 2, 2, 3, 4], "the skipped step must not advance Adam's step count"
    assert all(m.dtype == torch.float32 for m in s.masters[-1].values())
    assert all(p.dtype == torch.float16 for p in s.params[-1].values())


@pytest.mark.filterwarnings("ignore:precision='16-true' on CPU")
def test_hysteresis_tolerates_one_overflow_before_backing_off(tmp_path):
    module = InjectInf(ml.GPTConfig(**CONFIG), fp16_optimizer(hysteresis=2), inf_steps={1, 2})
    s = fit(module, 4, "16-true", tmp_path)
    assert s.skipped == [0, 0, 1, 2, 2]
    assert s.scales == [256.0, 256.0, 256.0, 128.0, 128.0]


@pytest.mark.filterwarnings("ignore:precision='16-true' on CPU")
def test_megatron_default_scale_overflows_at_first_then_trains(tmp_path):
    """2**32 overflows fp16 at once: steps are skipped and the scale backs off until the gradients fit."""
    module = ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant"))
    s = fit(module, 40, "16-true", tmp_path)
    skipped = s.skipped[-1]
    assert 0 < skipped < 40
    assert s.scales[-1] < 2.0**32
    assert s.skipped[-10:] == [skipped] * 10, "once the scale fits, steps stop being skipped"


def test_dynamic_scaler_follows_megatron():
    scaler = DynamicLossScaler(initial_scale=2.0**4, min_scale=2.0, growth_interval=3, hysteresis=2)
    trace = []
    for found_inf in [True, True, True, True, False, False, False, False, False, False, True]:
        scaler.update(found_inf)
        trace.append(scaler.scale)
    # hysteresis 2: the first overflow is tolerated; later ones back off until the tracker is refilled by a growth
    assert trace == [16, 8, 4, 2, 2, 2, 4, 4, 4, 8, 8]
    state = scaler.state_dict()
    again = DynamicLossScaler(initial_scale=2.0**4, min_scale=2.0, growth_interval=3, hysteresis=2)
    again.load_state_dict(state)
    assert again.state_dict() == state


def test_bf16_true_keeps_fp32_masters_and_tracks_fp32(tmp_path):
    config = ml.GPTConfig(**CONFIG)
    fp32 = fit(
        ml.GPTModule(config, ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant"), seed=5),
        6,
        "32-true",
        tmp_path / "fp32",
    )
    module = ml.GPTModule(config, ml.OptimizerConfig(lr=1e-3, lr_decay_style="constant"), seed=5)
    bf16 = fit(module, 6, "bf16-true", tmp_path / "bf16")
    assert all(p.dtype == torch.bfloat16 for p in bf16.params[-1].values())
    assert all(m.dtype == torch.float32 for m in bf16.masters[-1].values())
    handed_back = dict(module.model.named_parameters())
    for name, master in bf16.masters[-1].items():
        # weights are the rounded masters; masters move by less than a bf16 ulp per step and still move
        assert torch.equal(bf16.params[-1][name], master.to(torch.bfloat16)), name
        ref = fp32.params[-1][name]
        assert (master - ref).norm() <= 2e-2 * ref.norm() + 1e-3, name
        # the forked rank hands back the fp32 masters (issue 21(d)), not their bf16 rounding
        assert torch.equal(handed_back[name], master), name
    assert bf16.skipped[-1] == 0 and bf16.scales[-1] is None


def test_fp16_mixed_on_cpu_falls_back_to_bf16_with_a_warning(tmp_path):
    """CPU autocast has no fp16 AMP: Lightning warns and runs bf16-mixed, which MegatronStrategy honours."""
    with pytest.warns(UserWarning, match="Using `precision='bf16-mixed'` instead"):
        s = fit(ml.GPTModule(ml.GPTConfig(**CONFIG)), 2, "16-mixed", tmp_path)
    assert s.scales[-1] is None  # bf16 needs no loss scaling


def test_fsdp2_refuses_half_parameters(tmp_path):
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", use_torch_fsdp2=True),
        devices=2,
        accelerator="cpu",
        precision="bf16-true",
        max_steps=1,
        logger=False,
    )
    data = MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=256)
    with pytest.raises(ValueError, match="use precision='bf16-mixed'"):
        trainer.fit(ml.GPTModule(ml.GPTConfig(**CONFIG)), data)

"""LoRA in a notebook's session (issue 24): one process, the fork launcher. A LoRA fit at TP2 hands the trained
adapters back (the LoRA callback's setup ran in the ranks only: the adapters are rebuilt here from the recipe the
state carries); a later validate at TP2 and one at a single rank -- both WITHOUT the LoRA callback -- run the adapted
model: their val/loss equals this process's loss of the handed-back model, which differs from the base's; and
generate here continues with the adapted model's greedy token."""

from __future__ import annotations

import lightning as L
import torch

import megatron_lite as ml
from megatron_lite.callbacks import LoRA
from megatron_lite.core.parallel.schedules import gpt_loss
from megatron_lite.core.peft import adapters, adapters_disabled, has_adapters
from megatron_lite.data import MockGPTDataModule

CONFIG = dict(
    num_layers=2, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=16, make_vocab_size_divisible_by=128
)


def _data() -> MockGPTDataModule:
    return MockGPTDataModule(
        seq_length=16, micro_batch_size=2, global_batch_size=4, vocab_size=128, seed=3, num_val_samples=4
    )


def _trainer(tp: int, devices: int, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=tp, start_method="fork"),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        num_sanity_val_steps=0,
        **kwargs,
    )


def _val_loss(model: torch.nn.Module) -> float:
    dataset = _data().val_dataset
    tokens = torch.stack([dataset[i]["tokens"] for i in range(len(dataset))])
    with torch.no_grad():
        total, count = gpt_loss(model.eval(), {"tokens": tokens})
    return float(total / count)


def test_a_forked_lora_fit_hands_the_adapters_back_and_later_calls_use_them():
    module = ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(lr=5e-2, lr_warmup_iters=0), seed=1)
    module.configure_model()  # the base exists here first (as after from_pretrained): the ranks cut their shards
    base = {name: p.detach().clone() for name, p in module.model.named_parameters()}
    trainer = _trainer(2, 2, max_steps=4, limit_val_batches=0, callbacks=[LoRA(dim=4, alpha=8)])
    trainer.fit(module, _data())

    assert has_adapters(module.model)
    for name, adapter in adapters(module.model):
        assert adapter.linear_out.weight.abs().max() > 1e-3, f"{name}: the trained B was not handed back"
    for name, p in module.model.named_parameters():
        if name in base:
            assert torch.equal(p.detach(), base[name]), f"{name}: the frozen base changed"
    adapted = _val_loss(module.model)
    with adapters_disabled(module.model):
        assert abs(_val_loss(module.model) - adapted) > 1e-3  # the adapters change the function

    for tp, devices in ((2, 2), (1, 1)):  # no LoRA callback: the module's model carries its adapters
        validator = _trainer(tp, devices)
        validator.validate(module, _data())
        torch.testing.assert_close(float(validator.callback_metrics["val/loss"]), adapted, rtol=1e-5, atol=0)

    prompt = _data().val_dataset[0]["tokens"][:6]
    with torch.no_grad():
        greedy = int(module.full_logits(prompt[None])[0, -1, :128].argmax())
    out = module.generate([prompt.tolist()], max_new_tokens=1, temperature=0.0)
    assert out.tokens[0][0] == greedy

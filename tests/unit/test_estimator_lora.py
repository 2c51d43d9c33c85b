"""The estimator on a LoRA fine-tune: the adapters' tensors (sharded like their layers), gradients and optimizer
state for the adapters only (exact against the real optimizer's buffers), FLOPs without the base's weight gradients
(against torch's FLOP counter), and the run's LoRA found where the strategy, the start-up report and
``megatron-lite estimate`` look for it."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
import yaml
from test_estimator import TINY, _optimizer_bytes_after_a_step, _run, _tp_layout
from torch.utils.flop_counter import FlopCounterMode

import megatron_lite as ml
from megatron_lite.core.estimator import estimate_for_run, forward_flops_breakdown, parameter_shapes
from megatron_lite.core.estimator.flops import lora_parameters, training_flops_per_step
from megatron_lite.core.estimator.report import format_table
from megatron_lite.core.estimator.run import estimate_objective, trained_lora
from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.peft import LoRAConfig, apply_lora

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from spawn_utils import run_ranks  # noqa: E402

SHAPE = dict(TINY, num_query_groups=2)  # SwiGLU, GQA: fc1 is [gate; up], qkv narrower than 3h
LORA = dict(dim=4, alpha=8.0)
PARTIAL = dict(dim=2, target_modules=["linear_qkv", "*.layers.1.*.linear_fc2"])


@pytest.mark.parametrize("lora", [LORA, PARTIAL], ids=["all", "qkv+layer1_fc2"])
def test_parameter_shapes_are_the_adapted_model_at_tp1_and_its_shards_at_tp2(lora):
    """Names, local shapes and requires_grad of every tensor equal those of a model ``apply_lora`` adapted."""
    config, cfg = GPTConfig(**SHAPE), LoRAConfig(**lora)
    for tp, ranks in ((1, [0]), (2, [0, 1])):
        for rank in ranks:
            layout = _tp_layout(tp, rank)
            model = GPTModel(config, layout)
            apply_lora(model, cfg, layout, seed=1)
            expected = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
            got = [(p.name, p.shape, p.trainable) for p in parameter_shapes(config, tp, lora=cfg)]
            assert got == expected
    adapters = sum(p.numel for p in parameter_shapes(config, lora=cfg) if p.trainable)
    assert adapters == lora_parameters(config, cfg) > 0


@pytest.mark.parametrize(
    "precision, dp, distributed", [("32-true", 1, False), ("bf16-true", 1, False), ("bf16-true", 2, True)]
)
def test_gradients_and_optimizer_state_are_the_adapters_bytes_after_a_step(precision, dp, distributed):
    """The real Megatron optimizer over an adapted model (main-grad buffers, fp32 masters, ZeRO-1 shards, Adam's
    moments) holds exactly the estimated bytes; the frozen base counts in the weights only."""
    if dp == 1:
        measured = [_optimizer_bytes_after_a_step(0, 1, SHAPE, precision, distributed, lora=LORA)]
    else:
        measured = run_ranks(_optimizer_bytes_after_a_step, dp, SHAPE, precision, distributed, None, LORA)
    config = GPTConfig(**SHAPE)
    run = _run(config, 2, data_parallel_size=dp, precision=precision)
    optimizer = OptimizerConfig(use_distributed_optimizer=distributed)
    est = estimate_for_run(config, run, optimizer, device_type="cpu", lora=LoRAConfig(**LORA))
    full = estimate_for_run(config, run, optimizer, device_type="cpu")
    for rank in measured:
        assert (rank["weights"], rank["grads"], rank["optimizer"]) == (
            est.weights_bytes,
            est.grads_bytes,
            est.optimizer_bytes,
        )
        if not distributed:  # one step counter per trained tensor
            assert rank["counters"] == est.optimizer_host_bytes
    adapters = lora_parameters(config, LoRAConfig(**LORA))
    assert est.trainable_params == adapters and est.params == config.num_parameters() + adapters
    # the base still weighs what it did; its gradients and optimizer state are gone
    assert est.weights_bytes > full.weights_bytes and est.grads_bytes < full.grads_bytes / 10
    assert est.optimizer_bytes < full.optimizer_bytes / 10


def test_tensor_parallel_ranks_hold_the_estimated_adapter_bytes():
    """At TP2 each rank's adapters are its shards (B split on column layers, A on row layers): its gradient and
    optimizer bytes equal the estimate's."""
    measured = run_ranks(
        _optimizer_bytes_after_a_step, 2, SHAPE, "32-true", False, dict(tensor_model_parallel_size=2), LORA
    )
    config = GPTConfig(**SHAPE)
    est = estimate_for_run(
        config, _run(config, 2, tensor_model_parallel_size=2), device_type="cpu", lora=LoRAConfig(**LORA)
    )
    for rank in measured:
        assert (rank["weights"], rank["grads"], rank["optimizer"]) == (
            est.weights_bytes,
            est.grads_bytes,
            est.optimizer_bytes,
        )


def test_flop_counter_sees_no_weight_gradients_of_the_frozen_base():
    """One forward and backward of an adapted model under torch's FLOP counter: the base's weight matmuls cost their
    forward and input gradient (2 of 3), the adapters all three. Autograd also skips the input gradient of the first
    layer's QKV (base and adapter A): nothing below it trains; the estimate keeps that work, as the formula's
    convention says, so the test adds it back."""
    config, cfg = GPTConfig(**SHAPE), LoRAConfig(**LORA)
    model = GPTModel(config).train()
    apply_lora(model, cfg, ml.core.parallel.layout.ParallelLayout.single(), seed=1)
    tokens = torch.randint(0, config.vocab_size, (2, 32), generator=torch.Generator().manual_seed(0))
    with FlopCounterMode(display=False) as counter:
        model(tokens, tokens).sum().backward()
    counts = {str(op): n for op, n in counter.get_flop_counts()["Global"].items()}
    weight_matmuls = counts.pop("aten.mm", 0) + counts.pop("aten.addmm", 0)
    n = tokens.numel()
    qkv = config.kv_channels * (config.num_attention_heads + 2 * config.num_query_groups)
    skipped = 2 * n * config.hidden_size * (qkv + cfg.dim)  # layer 0's QKV input gradient: base and A
    per_token = forward_flops_breakdown(config, 32)
    adapters = 2.0 * lora_parameters(config, cfg)
    assert weight_matmuls + skipped == pytest.approx(n * (2 * per_token.matmul_with_weights + 3 * adapters), rel=1e-9)
    full = training_flops_per_step(config, 2, 32)
    lora = training_flops_per_step(config, 2, 32, lora=cfg)
    assert lora == pytest.approx(full - n * per_token.matmul_with_weights + 3 * n * adapters, rel=1e-12)


def test_the_run_finds_its_lora_in_the_callbacks_the_extension_or_the_model_and_the_report_says_so(tmp_path):
    """Before launch the LoRA callback is among the Trainer's callbacks; after its setup the module holds its
    extension; once the model is built it carries the recipe: each is found. A real fit's start-up estimate then
    has the live model's trainable parameters."""
    from megatron_lite.data import MockGPTDataModule

    config = GPTConfig(**SHAPE)
    module = ml.GPTModule(config, OptimizerConfig(lr=1e-3))
    callback = ml.callbacks.LoRA(**LORA)
    assert trained_lora(module) is None and trained_lora(module, [object(), callback]) == callback.config
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=2, vocab_size=config.vocab_size)
    run = _run(config, 2)
    assert estimate_objective(module, run, data, "cpu", [callback]).trainable_params == lora_parameters(
        config, callback.config
    )
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(),
        accelerator="cpu",
        devices=1,
        max_steps=1,
        callbacks=[callback],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        default_root_dir=tmp_path,
    )
    trainer.fit(module, data)
    assert trained_lora(module) == callback.config  # the recipe of the built model
    estimate = trainer.strategy.memory_estimate
    trainable = [p for p in module.model.parameters() if p.requires_grad]
    assert estimate.trainable_params == sum(p.numel() for p in trainable)
    assert estimate.grads_bytes == sum(p.numel() * p.element_size() for p in trainable)
    assert "of which trainable" in format_table(estimate)


def test_estimate_command_reads_the_lora_callback_from_the_yaml(tmp_path, capsys):
    """``megatron-lite estimate`` on a fit YAML with ``megatron_lite.callbacks.LoRA`` in ``trainer.callbacks``."""
    from megatron_lite.cli.estimate import main

    raw = yaml.safe_load((Path(__file__).resolve().parents[2] / "examples/configs/gpt_tiny.yaml").read_text())
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path), "--json"]) == 0
    full = json.loads(capsys.readouterr().out)
    raw["trainer"]["callbacks"] = [{"class_path": "megatron_lite.callbacks.LoRA", "init_args": {"dim": 8}}]
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path), "--json"]) == 0
    lora = json.loads(capsys.readouterr().out)
    assert lora["layout"]["lora"]["dim"] == 8 and lora["weights_bytes"] > full["weights_bytes"]
    assert 0 < lora["trainable_params"] < full["trainable_params"] == full["params"]
    assert lora["grads_bytes"] < full["grads_bytes"] and lora["flops_per_step"] < full["flops_per_step"]
    raw["trainer"]["callbacks"][0]["init_args"] = {"rank": 8}
    path.write_text(yaml.safe_dump(raw))
    assert main(["--config", str(path)]) == 2
    assert "LoRA does not take the init_args given" in capsys.readouterr().err


def test_an_moe_models_expert_adapters_are_estimated_as_built_and_counted_active_in_flops():
    """The experts' adapters ([experts, dim, in] and [experts, out, dim]) are in the estimate as ``apply_lora`` builds
    them (the shared expert's too); per token only the routed experts' adapters count in the FLOPs."""
    config = GPTConfig(
        **dict(SHAPE, num_moe_experts=4, moe_router_topk=2, moe_shared_expert_intermediate_size=32, ffn_hidden_size=48)
    )
    cfg = LoRAConfig(**LORA)
    model = GPTModel(config)
    apply_lora(model, cfg, model.layout, seed=1)
    expected = [(n, tuple(p.shape), p.requires_grad) for n, p in model.named_parameters()]
    assert [(p.name, p.shape, p.trainable) for p in parameter_shapes(config, lora=cfg)] == expected
    experts = sum(p.numel() for n, p in model.named_parameters() if ".experts.linear_fc" in n and ".adapter." in n)
    total = sum(p.numel() for p in model.parameters() if p.requires_grad)
    assert experts > 0 and lora_parameters(config, cfg) == total
    assert lora_parameters(config, cfg, active=True) == total - experts + experts * 2 // 4

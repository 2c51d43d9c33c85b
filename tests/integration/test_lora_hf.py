"""LoRA and Hugging Face PEFT both ways, against peft and transformers themselves (fp32, relative L2 error 1e-5).

A tiny random Llama (GQA, SwiGLU, untied) fine-tuned with the LoRA callback at TP2 under a real Trainer, its
checkpoint exported with the real CLI: ``--to hf-peft`` loads in ``peft.PeftModel`` on the HF base with our logits,
``--to hf --merge-lora`` loads in transformers with our logits, ``--to hf`` alone is refused. A PEFT adapter saved
by ``save_pretrained`` (random non-zero A and B, some projections on some layers) imported with
``from_pretrained(base, adapter=...)`` gives PEFT's logits and greedy tokens, exports back to the same logits, and
fine-tunes its adapters alone. What one fused adapter cannot hold is refused by name. Nothing is downloaded."""

from __future__ import annotations

import json
import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402

transformers = pytest.importorskip("transformers", reason="transformers is not installed (pip install -e '.[dev]')")
peft = pytest.importorskip("peft", reason="peft is not installed (pip install -e '.[dev]')")

from test_hf_interop import (  # noqa: E402
    VOCAB,
    _assert_close,
    _convert,
    _hf_logits,
    _random_hf_model,
    _save,
    _tokens,
    _trainer,
    cli_main_code,
)

import megatron_lite as ml  # noqa: E402
from megatron_lite.callbacks import LoRA  # noqa: E402
from megatron_lite.data import MockGPTDataModule  # noqa: E402
from megatron_lite.pretrained import save_weights_checkpoint  # noqa: E402

PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """(transformers Llama with GQA, SwiGLU and an untied head, its save_pretrained directory)."""
    model = _random_hf_model("llama_gqa_untied", seed=11)
    return model, _save(model, tmp_path_factory.mktemp("base"))


@pytest.fixture(scope="module")
def lora_checkpoint(base, tmp_path_factory):
    """A checkpoint of a LoRA fine-tune of ``base`` at TP2 (all four layers adapted), written by ModelCheckpoint."""
    _, directory = base
    out = tmp_path_factory.mktemp("lora_run")
    module = ml.GPTModule.from_pretrained(
        directory, seq_length=32, optimizer=ml.OptimizerConfig(lr=3e-2, lr_warmup_iters=0, lr_decay_style="constant")
    )
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=VOCAB, seed=5)
    _trainer(
        2,
        2,
        max_steps=3,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[
            LoRA(dim=4, alpha=8, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"]),
            ModelCheckpoint(dirpath=out, every_n_train_steps=3, save_top_k=-1),
        ],
    ).fit(module, data)
    return out / "epoch=0-step=3.ckpt"


def _ours(checkpoint: Path, tokens: torch.Tensor) -> torch.Tensor:
    return ml.GPTModule.from_pretrained(checkpoint).full_logits(tokens)


def _assert_adapted(logits: torch.Tensor, base_logits: torch.Tensor) -> None:
    error = float((logits - base_logits).norm() / base_logits.norm())
    assert error > 1e-2, f"the adapters change the logits by {error:.1e} only: the comparison would prove nothing"


def test_hf_peft_export_loads_in_peft_with_our_logits(base, lora_checkpoint, tmp_path):
    model, directory = base
    tokens = _tokens()
    ours = _ours(lora_checkpoint, tokens)
    _assert_adapted(ours, _hf_logits(model, tokens))
    _convert("--to", "hf-peft", "--input", lora_checkpoint, "--output", tmp_path / "adapter", "--base-model", "tiny")
    assert sorted(p.name for p in (tmp_path / "adapter").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "megatron_lite_output.json",
    ]
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert {k: config[k] for k in ("peft_type", "task_type", "r", "lora_alpha", "bias", "base_model_name_or_path")} == {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "r": 4,
        "lora_alpha": 8.0,
        "bias": "none",
        "base_model_name_or_path": "tiny",
    }
    assert config["target_modules"] == PROJECTIONS
    adapted = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path / "adapter"
    ).eval()
    # every adapter of ours was loaded (PEFT leaves a missing one at its initial zero B, which would hide a loss)
    with torch.no_grad():
        assert all(m.lora_B["default"].weight.abs().max() > 0 for m in adapted.modules() if hasattr(m, "lora_B"))
    _assert_close(ours, _hf_logits(adapted, tokens))
    # the same directory again: replaced with --overwrite only
    again = ["convert", "--to", "hf-peft", "--input", lora_checkpoint, "--output", tmp_path / "adapter"]
    assert cli_main_code(*again) == 2
    assert cli_main_code(*again, "--overwrite") == 0


def test_merged_export_loads_in_transformers_with_our_logits(base, lora_checkpoint, tmp_path, capsys):
    model, _ = base
    tokens = _tokens()
    assert cli_main_code("convert", "--to", "hf", "--input", lora_checkpoint, "--output", tmp_path / "plain") == 2
    message = capsys.readouterr().err
    assert "--merge-lora" in message and "--to hf-peft" in message, message
    assert not (tmp_path / "plain").exists()
    _convert("--to", "hf", "--merge-lora", "--input", lora_checkpoint, "--output", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged) is type(model)
    _assert_close(_ours(lora_checkpoint, tokens), _hf_logits(merged, tokens))


def _peft_adapter(model, directory: Path, **lora) -> tuple[object, Path]:
    """``model`` (a copy) under a PEFT LoRA adapter of ``lora`` with every A and B drawn non-zero, saved."""
    config = peft.LoraConfig(r=4, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM", **lora)
    adapted = peft.get_peft_model(_random_hf_model("llama_gqa_untied", seed=11), config)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, param in adapted.named_parameters():
            if "lora_" in name:
                param.copy_(0.2 * torch.randn(param.shape, generator=generator))
    adapted.save_pretrained(directory)
    return adapted.eval(), directory


@pytest.mark.parametrize(
    "lora",
    [
        dict(target_modules=PROJECTIONS),
        # q and v only (PEFT's usual choice), on layer 1 only, and the MLP's up projection without the gate
        dict(target_modules=["q_proj", "v_proj", "up_proj", "o_proj"], layers_to_transform=[1]),
    ],
    ids=["all-projections", "some-projections-one-layer"],
)
def test_peft_adapter_imports_with_peft_logits_and_exports_back(base, tmp_path, lora):
    model, directory = base
    adapted, adapter = _peft_adapter(model, tmp_path / "peft", **lora)
    tokens = _tokens()
    expected = _hf_logits(adapted, tokens)
    _assert_adapted(expected, _hf_logits(model, tokens))
    module = ml.GPTModule.from_pretrained(directory, adapter=adapter)
    _assert_close(module.full_logits(tokens), expected)
    prompt = tokens[:1, :8]
    greedy = adapted.generate(input_ids=prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert module.generate(prompt.tolist(), max_new_tokens=4).tokens == greedy[:, 8:].tolist()
    # saved as our checkpoint and exported again: PEFT loads it onto the base with the same logits
    save_weights_checkpoint(module, tmp_path / "ckpt", hf_source=directory)
    _convert("--to", "hf-peft", "--input", tmp_path / "ckpt", "--output", tmp_path / "back")
    back = peft.PeftModel.from_pretrained(
        transformers.AutoModelForCausalLM.from_pretrained(directory), tmp_path / "back"
    )
    _assert_close(_hf_logits(back.eval(), tokens), expected)


def test_an_imported_adapter_fine_tunes_alone(base, tmp_path):
    """fit() of the imported module without a LoRA callback trains the adapters and leaves the base as it was."""
    model, directory = base
    _, adapter = _peft_adapter(model, tmp_path / "peft", target_modules=["q_proj", "v_proj"])
    module = ml.GPTModule.from_pretrained(
        directory, adapter=adapter, seq_length=32, optimizer=ml.OptimizerConfig(lr=1e-2, lr_warmup_iters=0)
    )
    before = {n: p.detach().clone() for n, p in module.model.named_parameters()}
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=2, vocab_size=VOCAB, seed=5)
    _trainer(1, 1, max_steps=1, limit_val_batches=0).fit(module, data)
    after = dict(module.model.named_parameters())
    moved = {n for n in before if not torch.equal(before[n], after[n].detach())}
    assert moved and all(".adapter." in n for n in moved), sorted(moved)


def _edit_config(adapter: Path, **fields) -> Path:
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, **fields}))
    return adapter


@pytest.mark.parametrize(
    "fields, named",
    [
        (dict(use_dora=True), "use_dora"),
        (dict(use_rslora=True), "use_rslora"),
        (dict(bias="all"), "bias"),
        (dict(rank_pattern={"q_proj": 8}), "rank_pattern"),
        (dict(modules_to_save=["lm_head"]), "modules_to_save"),
        (dict(peft_type="IA3"), "peft_type"),
    ],
)
def test_what_a_fused_adapter_cannot_hold_is_refused_by_name(base, tmp_path, fields, named):
    model, directory = base
    _, adapter = _peft_adapter(model, tmp_path / "peft", target_modules=["q_proj"])
    with pytest.raises(ValueError, match=named):
        ml.GPTModule.from_pretrained(directory, adapter=_edit_config(adapter, **fields))


def test_adapters_on_other_modules_and_pickles_are_refused(base, tmp_path):
    model, directory = base
    _, adapter = _peft_adapter(model, tmp_path / "peft", target_modules=["q_proj", "lm_head"])
    with pytest.raises(ValueError, match="lm_head.*only the projections"):
        ml.GPTModule.from_pretrained(directory, adapter=adapter)
    (adapter / "adapter_model.safetensors").rename(adapter / "adapter_model.bin")
    with pytest.raises(FileNotFoundError, match="adapter_model.bin is never read"):
        ml.GPTModule.from_pretrained(directory, adapter=adapter)


def test_exports_of_a_checkpoint_without_adapters_are_refused(base, tmp_path, capsys):
    _, directory = base
    _convert("--from", "hf", "--input", directory, "--output", tmp_path / "ckpt")
    code = cli_main_code("convert", "--to", "hf-peft", "--input", tmp_path / "ckpt", "--output", tmp_path / "a")
    assert code == 2 and "holds no LoRA adapters" in capsys.readouterr().err
    code = cli_main_code(
        "convert", "--to", "hf", "--merge-lora", "--input", tmp_path / "ckpt", "--output", tmp_path / "m"
    )
    assert code == 2 and "leave --merge-lora out" in capsys.readouterr().err
    assert not (tmp_path / "a").exists() and not (tmp_path / "m").exists()


def test_a_lora_fine_tune_of_an_moe_model_merges_into_an_hf_moe_model(tmp_path):
    """The case merges fail on elsewhere: a Qwen2-MoE base (a gated shared expert, a dense layer) fine-tuned with LoRA
    on every linear layer -- its experts' too -- with the experts over 2 ranks, saved adapter-only, then exported with
    ``--merge-lora``: transformers loads a plain Qwen2-MoE model computing our adapted logits."""
    model = _random_hf_model("qwen2_moe_shared_expert", seed=3)
    directory = _save(model, tmp_path / "base")
    module = ml.GPTModule.from_pretrained(
        directory, seq_length=32, optimizer=ml.OptimizerConfig(lr=3e-2, lr_warmup_iters=0, lr_decay_style="constant")
    )
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=VOCAB, seed=5)
    lora = LoRA(dim=4, alpha=8, target_modules=["linear_qkv", "linear_proj", "linear_fc1", "linear_fc2"])
    checkpoints = ModelCheckpoint(dirpath=tmp_path / "run", every_n_train_steps=2, save_top_k=-1)
    _trainer(
        1,
        2,
        parallel=dict(expert_model_parallel_size=2),
        max_steps=2,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[lora, checkpoints],
    ).fit(module, data)
    checkpoint = tmp_path / "run" / "epoch=0-step=2.ckpt"
    tokens = _tokens()
    ours = _ours(checkpoint, tokens)
    adapted = ml.GPTModule.from_pretrained(checkpoint)
    assert any(".experts.linear_fc1.adapter." in name for name, _ in adapted.model.named_parameters())
    _assert_adapted(ours, _hf_logits(model, tokens))
    _convert("--to", "hf", "--merge-lora", "--input", checkpoint, "--output", tmp_path / "merged")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert type(merged) is type(model)
    _assert_close(ours, _hf_logits(merged, tokens))

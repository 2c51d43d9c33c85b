"""Hugging Face Llama interop against transformers itself: tiny random models (GQA untied, tied MHA, Llama-3.1
RoPE scaling, biases everywhere, Qwen2's q/k/v bias, Mistral without a window, Qwen3's q/k norms tied and untied,
and the mixtures of experts Mixtral, Qwen2-MoE with its gated shared expert and a dense layer, Qwen3-MoE) built
in-process and saved with save_pretrained, imported (one process and TP2 under a real Trainer), exported
with the CLI and loaded back in transformers; a model we trained at TP2 exported and loaded in transformers;
sharded safetensors with an index; bf16 weights; refusals. Logits are compared in fp32 by relative L2 error (1e-5).
Nothing is downloaded."""

from __future__ import annotations

import json
import os
import re

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported: never reach the hub
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

from pathlib import Path  # noqa: E402
from typing import Optional  # noqa: E402

import lightning as L  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

transformers = pytest.importorskip(
    "transformers",
    reason="transformers is not installed (pip install -e '.[dev]'): the HF interop tests build tiny models with it",
)
transformers.utils.logging.disable_progress_bar()
safetensors_torch = pytest.importorskip(
    "safetensors.torch", reason="safetensors is not installed (comes with transformers)"
)

import megatron_lite as ml  # noqa: E402
from megatron_lite.cli import main as cli_main  # noqa: E402
from megatron_lite.core.checkpoint.errors import UnsupportedHFModel  # noqa: E402
from megatron_lite.core.checkpoint.format.safetensors_io import read_safetensors_header  # noqa: E402
from megatron_lite.data import MockGPTDataModule  # noqa: E402
from megatron_lite.rl.dpo import reference_config  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
VOCAB = 200  # padded to 256 rows at TP1 and TP2: the padding is added on import and cut off on export
TOL = 1e-5
SMALL = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
)


def _llama(**kw):
    return transformers.LlamaConfig(**{**SMALL, **kw})


CASES = {
    "llama_gqa_untied": lambda: _llama(num_key_value_heads=2, tie_word_embeddings=False),
    "llama_tied_mha": lambda: _llama(num_key_value_heads=4, tie_word_embeddings=True, rms_norm_eps=1e-6),
    "llama31_rope_scaling": lambda: _llama(
        num_key_value_heads=2,
        max_position_embeddings=128,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "llama_biases_head_dim": lambda: _llama(num_key_value_heads=2, head_dim=8, attention_bias=True, mlp_bias=True),
    "qwen2_qkv_bias": lambda: transformers.Qwen2Config(
        **{**SMALL, "num_key_value_heads": 2, "tie_word_embeddings": True}
    ),
    "mistral_no_window": lambda: transformers.MistralConfig(
        **{**SMALL, "num_key_value_heads": 2, "sliding_window": None}
    ),
    # q_norm/k_norm (qk_layernorm) with a head width other than hidden / heads (64 / 4)
    "qwen3_gqa_tied": lambda: transformers.Qwen3Config(
        **{**SMALL, "num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": True}
    ),
    "qwen3_mha_untied": lambda: transformers.Qwen3Config(
        **{**SMALL, "num_key_value_heads": 4, "head_dim": 8, "tie_word_embeddings": False}
    ),
    # Mixture of experts: top-2 of 4 experts renormalised (Mixtral, Qwen3-MoE's norm_topk_prob) or not (Qwen2-MoE)
    "mixtral": lambda: transformers.MixtralConfig(
        **{**SMALL, "num_key_value_heads": 2, "intermediate_size": 48, "num_local_experts": 4}
    ),
    # a gated shared expert, q/k/v biases, and a dense MLP in layer 1 (mlp_only_layers)
    "qwen2_moe_shared_expert": lambda: transformers.Qwen2MoeConfig(
        **{**SMALL, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2},
        moe_intermediate_size=32,
        shared_expert_intermediate_size=40,
        mlp_only_layers=[1],
    ),
    # q/k norms, tied, MoE in layer 1 only (decoder_sparse_step=2)
    "qwen3_moe_tied": lambda: transformers.Qwen3MoeConfig(
        **{**SMALL, "num_key_value_heads": 2, "head_dim": 24, "tie_word_embeddings": True},
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        norm_topk_prob=True,
        decoder_sparse_step=2,
    ),
}


def _random_hf_model(case: str, seed: int = 0, dtype: torch.dtype = torch.float32):
    """A transformers model of ``case`` with every parameter drawn (norm weights near 1, biases non-zero)."""
    model = transformers.AutoModelForCausalLM.from_config(CASES[case]())
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            param.copy_(1.0 + 0.1 * noise if "norm" in name else 0.05 * noise)
    return model.to(dtype).eval()


def _save(model, directory: Path, **kwargs) -> Path:
    model.save_pretrained(directory, **kwargs)
    # A tokenizer beside the weights (any HF tokenizer files: here the Llama SentencePiece model of tests/data).
    (directory / "tokenizer.model").write_bytes((REPO / "tests/data/tokenizers/llama-sp/tokenizer.model").read_bytes())
    (directory / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "LlamaTokenizer"}))
    return directory


@pytest.fixture(scope="module")
def hf_models(tmp_path_factory):
    """{case: (transformers model, its save_pretrained directory)}, built once per module."""
    out = {}
    for i, case in enumerate(CASES):
        model = _random_hf_model(case, seed=i)
        out[case] = (model, _save(model, tmp_path_factory.mktemp(case)))
    return out


def _tokens(n: int = 2, s: int = 24, seed: int = 7) -> torch.Tensor:
    return torch.randint(0, VOCAB, (n, s), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def _hf_logits(model, tokens: torch.Tensor) -> torch.Tensor:
    return model(tokens).logits.float()


def _assert_close(ours: torch.Tensor, reference: torch.Tensor) -> None:
    assert ours.shape == reference.shape
    error = float((ours.float() - reference).norm() / reference.norm())
    assert error <= TOL, f"relative L2 error {error:.2e} > {TOL}"


def _convert(*args: str) -> None:
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["convert", *map(str, args)])
    assert exit_info.value.code == 0


def _trainer(tp: int, devices: int, parallel: Optional[dict] = None, **kwargs) -> L.Trainer:
    return L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=tp, start_method="fork", **(parallel or {})),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        **{"enable_checkpointing": False, **kwargs},
    )


@pytest.mark.parametrize("case", list(CASES))
def test_import_gives_transformers_logits_in_one_process(case, hf_models):
    model, directory = hf_models[case]
    module = ml.GPTModule.from_pretrained(directory)  # no Trainer, no process group
    tokens = _tokens()
    logits = module.full_logits(tokens)
    assert logits.dtype == torch.float32 and logits.shape == (2, 24, VOCAB)
    _assert_close(logits, _hf_logits(model, tokens))
    # greedy generation continues the prompt as transformers does
    prompt = tokens[:1, :8]
    expected = model.generate(prompt, max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert module.generate(prompt.tolist(), max_new_tokens=4).tokens == expected[:, 8:].tolist()


@pytest.mark.parametrize("case", ["llama_gqa_untied", "qwen2_qkv_bias", "qwen3_gqa_tied"])
def test_import_gives_transformers_logits_at_tp2_under_a_trainer(case, hf_models, tmp_path):
    model, directory = hf_models[case]
    # 4 x 32 x 200 fp32 logits: 100 KiB, more than the pipe that carried rank 0's predictions used to hold
    # (the ranks then blocked on it forever)
    tokens = _tokens(n=4, s=32)
    reference = _hf_logits(model, tokens)
    loader = DataLoader([{"tokens": t} for t in tokens], batch_size=4)
    predicted = _trainer(2, 2).predict(ml.GPTModule.from_pretrained(directory), loader)
    _assert_close(torch.cat(predicted), reference)
    # The converted checkpoint is also an ordinary checkpoint for the strategy: predict(ckpt_path=...) at TP2
    # into a module whose weights are random.
    _convert("--from", "hf", "--input", directory, "--output", tmp_path / "ckpt")
    fresh = ml.GPTModule(ml.GPTModule.from_pretrained(tmp_path / "ckpt").config, seed=99)
    predicted = _trainer(2, 2).predict(fresh, loader, ckpt_path=str(tmp_path / "ckpt"))
    _assert_close(torch.cat(predicted), reference)


def test_moe_import_gives_transformers_logits_at_tp2_ep2_under_a_trainer(hf_models, tmp_path):
    """Qwen2-MoE at TP2 + SP with its experts split over EP2 (ETP1): each rank holds two of the four experts."""
    model, directory = hf_models["qwen2_moe_shared_expert"]
    tokens = _tokens(n=4, s=32)
    loader = DataLoader([{"tokens": t} for t in tokens], batch_size=4)
    reference = _hf_logits(model, tokens)
    parallel = dict(expert_model_parallel_size=2, expert_tensor_parallel_size=1, sequence_parallel=True)
    predicted = _trainer(2, 2, parallel).predict(ml.GPTModule.from_pretrained(directory), loader)
    _assert_close(torch.cat(predicted), reference)
    # The converted checkpoint (experts saved whole) loads at EP2 into a module whose weights are random.
    _convert("--from", "hf", "--input", directory, "--output", tmp_path / "ckpt")
    fresh = ml.GPTModule(ml.GPTModule.from_pretrained(tmp_path / "ckpt").config, seed=99)
    predicted = _trainer(2, 2, parallel).predict(fresh, loader, ckpt_path=str(tmp_path / "ckpt"))
    _assert_close(torch.cat(predicted), reference)


def test_transformers_5_fused_expert_layout_is_read(hf_models, tmp_path):
    """save_pretrained(save_original_format=False) keeps transformers 5's own layout (experts.gate_up_proj
    [E, 2f, h], experts.down_proj, Mixtral's block under mlp.): it imports to the same model."""
    tokens = _tokens()
    for case in ("mixtral", "qwen2_moe_shared_expert"):
        model, _ = hf_models[case]
        fused = _save(model, tmp_path / case, save_original_format=False)
        names = read_safetensors_header(fused / "model.safetensors")[0]
        assert (
            "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.experts.0.w1.weight" not in names
        )
        _assert_close(ml.GPTModule.from_pretrained(fused).full_logits(tokens), _hf_logits(model, tokens))


class FirstLoss(L.Callback):
    """Rank 0's loss of the first step, written to a file (the callback runs in the forked ranks)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx) -> None:
        if trainer.global_rank == 0 and batch_idx == 0:
            self.path.write_text(json.dumps(float(outputs["loss"])))


def test_fine_tuning_at_tp2_starts_from_the_imported_weights(hf_models, tmp_path):
    """from_pretrained, then fit at TP2: the first step's loss is transformers' cross entropy on that batch."""
    model, directory = hf_models["llama_gqa_untied"]
    # make_vocab_size_divisible_by=100: no padded vocabulary rows at TP1 or TP2, whose logits would otherwise
    # take part in our softmax (until padded logits are masked) and not in transformers'.
    module = ml.GPTModule.from_pretrained(
        directory,
        seq_length=32,
        make_vocab_size_divisible_by=100,
        optimizer=ml.OptimizerConfig(lr=1e-3, lr_warmup_iters=0),
    )
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=VOCAB, seed=5)
    tokens = torch.stack([data.train_dataset[i]["tokens"] for i in range(4)])
    logits = _hf_logits(model, tokens[:, :-1])
    expected = float(torch.nn.functional.cross_entropy(logits.reshape(-1, VOCAB), tokens[:, 1:].reshape(-1)))
    _trainer(2, 2, max_steps=2, limit_val_batches=0, callbacks=[FirstLoss(tmp_path / "loss.json")]).fit(module, data)
    assert json.loads((tmp_path / "loss.json").read_text()) == pytest.approx(expected, rel=1e-5)


@pytest.mark.parametrize("case", list(CASES))
def test_convert_round_trip_through_our_checkpoint(case, hf_models, tmp_path):
    model, directory = hf_models[case]
    ckpt, exported = tmp_path / "ckpt", tmp_path / "hf"
    _convert("--from", "hf", "--input", directory, "--output", ckpt)
    assert sorted(p.name for p in (ckpt / "hf").iterdir()) == [
        "config.json",
        "generation_config.json",
        "tokenizer.model",
        "tokenizer_config.json",
    ]
    tokens = _tokens()
    reference = _hf_logits(model, tokens)
    _assert_close(ml.GPTModule.from_pretrained(ckpt).full_logits(tokens), reference)

    _convert("--to", "hf", "--input", ckpt, "--output", exported)
    original, written = (
        safetensors_torch.load_file(directory / "model.safetensors"),
        safetensors_torch.load_file(exported / "model.safetensors"),
    )
    assert written.keys() == original.keys()
    for name in original:  # bit for bit: the fused layouts were split back exactly, padding rows cut off
        assert torch.equal(written[name], original[name]), name
    for name in ("tokenizer.model", "tokenizer_config.json", "generation_config.json"):
        assert (exported / name).read_bytes() == (directory / name).read_bytes()
    config = json.loads((exported / "config.json").read_text())
    source = json.loads((directory / "config.json").read_text())
    assert config["model_type"] == source["model_type"]
    assert (config.get("bos_token_id"), config.get("eos_token_id")) == (
        source.get("bos_token_id"),
        source.get("eos_token_id"),
    )
    loaded = transformers.AutoModelForCausalLM.from_pretrained(exported).eval()
    assert type(loaded) is type(model)
    _assert_close(_hf_logits(loaded, tokens), reference)


def test_a_model_trained_at_tp2_loads_in_transformers(tmp_path):
    """Trained by us (real Trainer, TP2, mock data), saved by the ranks through ModelCheckpoint, exported with the
    CLI (with a tokenizer directory), loaded by transformers: its logits are the trained model's."""
    config = ml.GPTConfig(
        num_layers=2,
        hidden_size=64,
        num_attention_heads=4,
        num_query_groups=2,
        ffn_hidden_size=96,
        vocab_size=VOCAB,
        seq_length=32,
        layernorm_epsilon=1e-5,
        rotary_base=500000.0,
    )
    module = ml.GPTModule(config, ml.OptimizerConfig(lr=1e-2, lr_warmup_iters=0, lr_decay_style="constant"), seed=3)
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=VOCAB, seed=5)
    before = ml.GPTModule(config, seed=3).build_model(ml.ParallelLayout.single()).eval().full_logits(_tokens())
    _trainer(
        2,
        2,
        max_steps=3,
        limit_val_batches=0,
        enable_checkpointing=True,
        callbacks=[ModelCheckpoint(dirpath=tmp_path / "ckpts", every_n_train_steps=3, save_top_k=-1)],
    ).fit(module, data)
    saved = tmp_path / "ckpts" / "epoch=0-step=3.ckpt"
    tokenizer = tmp_path / "tok"
    tokenizer.mkdir()
    (tokenizer / "tokenizer.model").write_bytes((REPO / "tests/data/tokenizers/llama-sp/tokenizer.model").read_bytes())
    _convert("--to", "hf", "--input", saved, "--output", tmp_path / "hf", "--tokenizer", tokenizer)
    assert (tmp_path / "hf" / "tokenizer.model").is_file()
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    assert isinstance(loaded, transformers.LlamaForCausalLM) and loaded.config.rope_parameters["rope_theta"] == 500000.0
    tokens = _tokens()
    trained = module.model.eval().full_logits(tokens)  # the model the ranks handed back
    assert float((trained - before).norm() / before.norm()) > 1e-2, "training changed nothing"
    _assert_close(trained, _hf_logits(loaded, tokens))
    _assert_close(ml.GPTModule.from_pretrained(saved).full_logits(tokens), trained)  # the TP2 checkpoint, read whole


def test_sharded_safetensors_with_an_index_both_ways(hf_models, tmp_path):
    model, _ = hf_models["llama_gqa_untied"]
    sharded = _save(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").is_file() and len(list(sharded.glob("*.safetensors"))) > 2
    tokens = _tokens()
    reference = _hf_logits(model, tokens)
    _assert_close(ml.GPTModule.from_pretrained(sharded).full_logits(tokens), reference)

    _convert("--from", "hf", "--input", sharded, "--output", tmp_path / "ckpt")
    _convert("--to", "hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "out", "--max-shard-size", "40KB")
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    files = sorted(p.name for p in (tmp_path / "out").glob("*.safetensors"))
    assert len(files) > 2 and sorted(set(index["weight_map"].values())) == files
    assert index["metadata"]["total_size"] == sum(
        t.numel() * t.element_size() for t in model.state_dict().values() if t is not None
    )
    _assert_close(
        _hf_logits(transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval(), tokens), reference
    )


def test_index_shard_paths_outside_the_model_directory_are_refused(hf_models, tmp_path):
    """A crafted model.safetensors.index.json may name any file on the machine: only file names inside the model
    directory are read (even when the file named is there and readable)."""
    model, _ = hf_models["llama_gqa_untied"]
    sharded = _save(model, tmp_path / "model", max_shard_size="40KB")
    index_path = sharded / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    first = sorted(set(index["weight_map"].values()))[0]
    (tmp_path / "elsewhere").mkdir()
    (sharded / first).rename(tmp_path / "elsewhere" / first)
    for outside in (f"../elsewhere/{first}", str(tmp_path / "elsewhere" / first)):
        crafted = {
            **index,
            "weight_map": {name: (outside if file == first else file) for name, file in index["weight_map"].items()},
        }
        index_path.write_text(json.dumps(crafted))
        message = rf"{re.escape(str(index_path))} names the shard {re.escape(repr(outside))}, which is not a file name"
        with pytest.raises(ValueError, match=message + r" inside the model directory"):
            ml.GPTModule.from_pretrained(sharded)


def test_a_config_json_nested_past_the_recursion_limit_is_named(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": ' + "[" * 100_000 + "]" * 100_000 + "}")
    with pytest.raises(ValueError, match=rf"^{re.escape(str(tmp_path / 'config.json'))} is malformed"):
        ml.GPTModule.from_pretrained(tmp_path)


def test_a_tied_config_with_a_distinct_lm_head_loads_as_transformers_loads_it(hf_models, tmp_path, caplog):
    """config.json says tie_word_embeddings=true, yet model.safetensors holds an lm_head.weight that is not the
    embedding: transformers keeps the two apart (and warns), and so do we (and a DPO reference's config says so
    too). An lm_head.weight equal to the embedding (what some writers add to a tied model) is tied, as
    transformers ties it."""
    model, directory = hf_models["llama_gqa_untied"]
    tokens = _tokens()
    for lm_head, tied in (("distinct", False), ("a copy of the embedding", True)):
        path = tmp_path / lm_head.replace(" ", "_")
        path.mkdir()
        config = json.loads((directory / "config.json").read_text())
        (path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
        tensors = safetensors_torch.load_file(directory / "model.safetensors")
        if tied:
            tensors["lm_head.weight"] = tensors["model.embed_tokens.weight"].clone()
        assert torch.equal(tensors["lm_head.weight"], tensors["model.embed_tokens.weight"]) is tied
        safetensors_torch.save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
        reference = transformers.AutoModelForCausalLM.from_pretrained(path).eval()
        caplog.clear()
        module = ml.GPTModule.from_pretrained(path)
        assert module.config.share_embeddings_and_output_weights is tied
        assert ("sets tie_word_embeddings=true, but" in caplog.text) is not tied
        _assert_close(module.full_logits(tokens), _hf_logits(reference, tokens))
        assert reference_config(str(path)) == module.config


def test_bf16_weights_import_and_export(tmp_path):
    model = _random_hf_model("llama_gqa_untied", seed=11, dtype=torch.bfloat16)
    directory = _save(model, tmp_path / "bf16")
    dtypes = {dtype for dtype, _ in read_safetensors_header(directory / "model.safetensors")[0].values()}
    assert dtypes == {"BF16"}
    module = ml.GPTModule.from_pretrained(directory)
    assert module.model.embedding.weight.dtype == torch.float32
    torch.testing.assert_close(
        module.model.embedding.weight[:VOCAB], model.model.embed_tokens.weight.float(), rtol=0, atol=0
    )  # bf16 -> fp32 is exact
    assert module.model.embedding.weight[VOCAB:].abs().sum() == 0  # padding rows are zero
    tokens = _tokens()
    as_fp32 = transformers.AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    _assert_close(module.full_logits(tokens), _hf_logits(as_fp32, tokens))

    _convert("--from", "hf", "--input", directory, "--output", tmp_path / "ckpt")
    _convert("--to", "hf", "--input", tmp_path / "ckpt", "--output", tmp_path / "out", "--dtype", "bfloat16")
    written = safetensors_torch.load_file(tmp_path / "out" / "model.safetensors")
    original = safetensors_torch.load_file(directory / "model.safetensors")
    assert all(written[n].dtype == torch.bfloat16 and torch.equal(written[n], original[n]) for n in original)
    assert json.loads((tmp_path / "out" / "config.json").read_text())["torch_dtype"] == "bfloat16"


def test_unsupported_architecture_is_refused_by_name(tmp_path, capsys):
    gpt2 = tmp_path / "gpt2"
    transformers.GPT2LMHeadModel(
        transformers.GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=VOCAB)
    ).save_pretrained(gpt2)
    with pytest.raises(
        UnsupportedHFModel,
        match=r"model_type 'gpt2' \(architectures \['GPT2LMHeadModel'\]\) is not "
        r"supported .*\['deepseek_v3', 'llama', 'mistral', 'mixtral', 'qwen2', 'qwen2_moe', 'qwen3', 'qwen3_moe'\]",
    ):
        ml.GPTModule.from_pretrained(gpt2)
    window = tmp_path / "mistral"
    transformers.MistralForCausalLM(
        transformers.MistralConfig(**{**SMALL, "num_key_value_heads": 2, "sliding_window": 16})
    ).save_pretrained(window)
    capsys.readouterr()
    assert cli_main_code("convert", "--from", "hf", "--input", window, "--output", tmp_path / "ckpt") == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "sliding_window=16" in err and '"sliding_window": null' in err
    assert not (tmp_path / "ckpt").exists()


def test_pickled_weights_are_never_read(hf_models, tmp_path):
    _, directory = hf_models["llama_gqa_untied"]
    pickled = tmp_path / "bin"
    pickled.mkdir()
    (pickled / "config.json").write_bytes((directory / "config.json").read_bytes())
    (pickled / "pytorch_model.bin").write_bytes(b"not opened")
    with pytest.raises(FileNotFoundError, match=r"only safetensors weights are read.*pytorch_model\.bin.*never loaded"):
        ml.GPTModule.from_pretrained(pickled)


def test_a_different_shape_names_the_parameters_and_both_shapes(hf_models, tmp_path):
    _, directory = hf_models["llama_gqa_untied"]
    with pytest.raises(
        ValueError,
        match=r"6 parameter\(s\) of another shape: model\.layers\.0\.mlp\.gate_proj\.weight: "
        r"saved \(96, 64\), expected \(128, 64\)",
    ):
        ml.GPTModule.from_pretrained(directory, ffn_hidden_size=128)
    _convert("--from", "hf", "--input", directory, "--output", tmp_path / "ckpt")
    with pytest.raises(
        ValueError,
        match=r"layers\.0\.self_attention\.linear_qkv\.weight: saved \(128, 64\), "
        r"expected \(192, 64\);.*layers\.1\.self_attention\.linear_qkv\.weight",
    ):
        ml.GPTModule.from_pretrained(tmp_path / "ckpt", num_query_groups=4)


def cli_main_code(*args) -> int:
    with pytest.raises(SystemExit) as exit_info:
        cli_main([str(a) for a in args])
    return exit_info.value.code

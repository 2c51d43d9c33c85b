"""Generation around a real Trainer: a TP2 fit on the bundled corpus (its SentencePiece tokenizer trained
by the datamodule) writes a checkpoint; ``trainer.predict`` with a PromptDataModule and the
``megatron-lite generate`` CLI continue prompts from it at several layouts, and agree with
``GPTModule.generate`` in this process."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite import cli
from megatron_lite.core.checkpoint.format.integrity import read_manifest
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta
from megatron_lite.data import PromptDataModule, TextCorpusDataModule
from megatron_lite.tokenizers.build import build_recorded_tokenizer

REPO = Path(__file__).resolve().parents[2]
TEXTS = ["ROMEO:\nWhat light", "To be, or not", "KING"]
CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=512,
    seq_length=32,
    make_vocab_size_divisible_by=64,
)


def _trainer(devices: int = 1, **strategy) -> L.Trainer:
    """Ranks forked from the test; one device runs in this process (the module keeps the loaded model)."""
    start_method = "fork" if devices > 1 else "popen"
    return L.Trainer(
        strategy=ml.MegatronStrategy(start_method=start_method, **strategy),
        accelerator="cpu",
        devices=devices,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A checkpoint of 12 TP2 steps, written by ModelCheckpoint in the ranks."""
    out = tmp_path_factory.mktemp("generation")
    data = TextCorpusDataModule(
        "shakespeare",
        seq_length=32,
        micro_batch_size=4,
        global_batch_size=8,
        vocab_size=512,
        cache_dir=str(out / "cache"),
    )
    module = ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(lr=3e-3, lr_warmup_iters=2))
    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(tensor_model_parallel_size=2, start_method="fork"),
        accelerator="cpu",
        devices=2,
        max_steps=12,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpt", filename="last", every_n_train_steps=12)],
    )
    trainer.fit(module, data)
    return out / "ckpt" / "last.ckpt"


def _tokenizer(checkpoint: Path):
    """The tokenizer the checkpoint records: the one the datamodule trained (its files copied into the checkpoint)."""
    meta = read_checkpoint_meta(checkpoint, [ml.GPTConfig, ml.OptimizerConfig])
    return build_recorded_tokenizer(meta["megatron_lite_tokenizer"], checkpoint)


def _predict(checkpoint: Path, prompts, devices: int = 1, batch_size: int = 2, **options) -> list[list[int]]:
    module = ml.GPTModule(ml.GPTConfig(**CONFIG))  # weights from ckpt_path, in every rank
    tp = options.pop("tp", 1)
    pp = options.pop("pp", 1)
    data = PromptDataModule(prompts, batch_size=batch_size, max_new_tokens=10, **options)
    batches = _trainer(devices, tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp).predict(
        module, datamodule=data, ckpt_path=str(checkpoint)
    )
    assert all(b.shape[1] == 10 and b.dtype == torch.int64 for b in batches)
    return [row[row >= 0].tolist() for b in batches for row in b]


def test_predict_with_prompts_equals_generate_at_every_layout(checkpoint):
    tokenizer = _tokenizer(checkpoint)
    prompts = [tokenizer.tokenize(t) for t in TEXTS]
    assert len({len(p) for p in prompts}) > 1  # prompts of different lengths share batches
    sampled = dict(temperature=0.9, top_p=0.9, seed=3)
    one = _predict(checkpoint, prompts)
    one_sampled = _predict(checkpoint, prompts, **sampled)
    # The same weights in this process, without a Trainer
    assert one == ml.GPTModule.from_pretrained(checkpoint).generate(prompts, 10).tokens
    assert one_sampled != one
    # A prompt's samples depend on its index in the dataset, not on the batch it shares
    assert one_sampled == _predict(checkpoint, prompts, batch_size=3, **sampled)
    assert _predict(checkpoint, prompts, devices=2, tp=2) == one
    assert _predict(checkpoint, prompts, devices=2, tp=2, **sampled) == one_sampled
    assert _predict(checkpoint, prompts, devices=2, pp=2) == one
    assert _predict(checkpoint, prompts, devices=2, **sampled) == one_sampled  # DP2: each replica its prompts


def test_predict_refuses_prompts_that_do_not_fit_before_launch(checkpoint):
    module = ml.GPTModule(ml.GPTConfig(**CONFIG))
    data = PromptDataModule([[1] * 30], max_new_tokens=10)
    with pytest.raises(ValueError, match="lower max_new_tokens to 2"):
        _trainer(2, tensor_model_parallel_size=2).predict(module, datamodule=data, ckpt_path=str(checkpoint))
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        _trainer().predict(module, datamodule=PromptDataModule([[600]], max_new_tokens=1), ckpt_path=str(checkpoint))


def _cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    env.pop("MASTER_PORT", None)
    return subprocess.run(
        [sys.executable, "-m", "megatron_lite", "generate", *args],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )


def test_cli_generates_from_a_trainer_checkpoint(checkpoint, tmp_path, capsys):
    """The text output from the CLI's entry in this process (one device: no launch); TP2 and JSON through
    `python -m megatron_lite generate`, a process of its own, as a user runs it."""
    tokenizer = _tokenizer(checkpoint)
    prompts = [tokenizer.tokenize(t) for t in TEXTS[:2]]
    expected = _predict(checkpoint, prompts, stop_ids=[tokenizer.eod])
    args = ["--ckpt", str(checkpoint), "--prompt", TEXTS[0], "--prompt", TEXTS[1], "--max-new-tokens", "10"]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["generate", *args])
    text = capsys.readouterr()
    assert exit_code.value.code == 0, text.err[-3000:]
    completions = [tokenizer.detokenize(p + e)[len(tokenizer.detokenize(p)) :] for p, e in zip(prompts, expected)]
    assert text.out == f"{TEXTS[0]}{completions[0]}\n\n{TEXTS[1]}{completions[1]}\n"
    tp2 = _cli(*args, "--json", "--devices", "2", "--tensor-model-parallel-size", "2", cwd=tmp_path)
    assert tp2.returncode == 0, tp2.stderr[-3000:]
    records = [json.loads(line) for line in tp2.stdout.splitlines()]
    assert [r["new_tokens"] for r in records] == expected
    assert [r["prompt_tokens"] for r in records] == prompts
    assert [r["completion"] for r in records] == completions


def test_a_trainer_checkpoint_carries_its_tokenizer(checkpoint, tmp_path, capsys):
    """The datamodule trained its tokenizer into a cache folder; the checkpoint the ranks wrote holds a copy
    (checksummed with it), so it generates and exports its tokenizer after the cache is gone."""
    meta = read_checkpoint_meta(checkpoint, [ml.GPTConfig, ml.OptimizerConfig])
    assert meta["megatron_lite_tokenizer"] == {
        "tokenizer_type": "SentencePieceTokenizer",
        "tokenizer_model": "tokenizer/tokenizer.model",
    }
    assert "tokenizer/tokenizer.model" in read_manifest(checkpoint).files
    cache = checkpoint.parents[1] / "cache"
    tokenizer = _tokenizer(checkpoint)
    expected = (
        ml.GPTModule.from_pretrained(checkpoint)
        .generate([tokenizer.tokenize(TEXTS[0])], 4, stop_ids=[tokenizer.eod])
        .tokens[0]
    )
    cache.rename(tmp_path / "cache.gone")
    try:
        with pytest.raises(SystemExit) as exit_code:
            cli.main(["generate", "--ckpt", str(checkpoint), "--prompt", TEXTS[0], "--max-new-tokens", "4", "--json"])
        assert exit_code.value.code == 0
        assert json.loads(capsys.readouterr().out.strip().splitlines()[-1])["new_tokens"] == expected
        with pytest.raises(SystemExit) as exit_code:
            cli.main(["convert", "--to", "hf", "--input", str(checkpoint), "--output", str(tmp_path / "hf")])
        assert exit_code.value.code == 0
    finally:
        (tmp_path / "cache.gone").rename(cache)
    assert (tmp_path / "hf" / "tokenizer.model").read_bytes() == (checkpoint / "tokenizer/tokenizer.model").read_bytes()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--top-p", "1.5"], r"top_p must be in \(0, 1\]"),
        (["--temperature", "-1"], "temperature must be a finite number >= 0"),
        (["--top-k", "-2"], "top_k must be an integer >= 0"),
        (["--max-new-tokens", "40"], "lower max_new_tokens to"),
        (["--tokenizer-type", "NullTokenizer"], "NullTokenizer needs vocab_size"),
    ],
)
def test_cli_bad_input_is_one_line(checkpoint, capsys, args, message):
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["generate", "--ckpt", str(checkpoint), "--prompt", "ROMEO:", *args])
    err = capsys.readouterr().err
    assert exit_code.value.code == 2
    assert err.startswith("megatron-lite: error: ") and len(err.strip().splitlines()) == 1, err
    assert re.search(message, err), err


def test_cli_names_a_missing_checkpoint(tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_code:
        cli.main(["generate", "--ckpt", str(tmp_path / "nope"), "--prompt", "x"])
    assert exit_code.value.code == 2
    assert (
        "nope does not exist; pass a local Hugging Face model directory or one of our checkpoints"
        in capsys.readouterr().err
    )


class GenerateAtTrainEnd(L.Callback):
    """Every rank generates after fit (the sharded model, in the run's process groups); rank 0 saves its
    result beside a greedy loop over the module's full logits (the training forward, with FSDP's hooks)."""

    def __init__(self, out: Path):
        self.out = out

    def on_train_end(self, trainer, pl_module):
        prompts = [[5, 17, 42, 8], [7]]
        generated = pl_module.generate(prompts, 6, return_log_probs=True)
        expected = []
        for prompt in prompts:
            seq = torch.tensor([prompt])
            for _ in range(6):
                seq = torch.cat([seq, pl_module.full_logits(seq)[:, -1].argmax(-1, keepdim=True)], dim=1)
            expected.append(seq[0, len(prompt) :].tolist())
        if trainer.global_rank == 0:
            torch.save({"generated": generated.tokens, "expected": expected}, self.out / "generated.pt")


def test_generate_inside_a_trainer_under_fsdp2(tmp_path):
    """FSDP2 over DP2: the parameters are gathered once for the generation, not per layer per token, and
    sharded again afterwards (the model still trains and its hooks still work: full_logits above)."""
    from megatron_lite.data import MockGPTDataModule

    trainer = L.Trainer(
        strategy=ml.MegatronStrategy(start_method="fork", use_torch_fsdp2=True),
        accelerator="cpu",
        devices=2,
        max_steps=2,
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
        enable_checkpointing=False,
        limit_val_batches=0,
        callbacks=[GenerateAtTrainEnd(tmp_path)],
    )
    data = MockGPTDataModule(seq_length=32, micro_batch_size=2, global_batch_size=4, vocab_size=512, seed=1)
    trainer.fit(ml.GPTModule(ml.GPTConfig(**CONFIG), ml.OptimizerConfig(lr=1e-2)), data)
    result = torch.load(tmp_path / "generated.pt")
    assert result["generated"] == result["expected"]


def test_cli_generates_with_an_moe_model_whose_experts_span_the_replicas(tmp_path, capsys):
    """EP2 over two data-parallel replicas, one prompt per batch: the predict split gives one replica two batches and
    the other one (so it serves the other's second generation with its experts), and the text is one process's."""
    from megatron_lite.pretrained import save_weights_checkpoint
    from megatron_lite.tokenizers import NullTokenizer

    config = ml.GPTConfig(**{**CONFIG, "num_moe_experts": 4, "moe_router_topk": 2, "ffn_hidden_size": 64})
    module = ml.GPTModule(config, seed=5)
    module.configure_model()
    path = save_weights_checkpoint(module, tmp_path / "moe", tokenizer=NullTokenizer(config.vocab_size))
    prompts = [[5, 17, 42], [7], [3, 4, 100, 9, 9]]
    expected = module.generate(prompts, 6).tokens
    args = [arg for p in prompts for arg in ("--prompt", " ".join(map(str, p)))]
    capsys.readouterr()
    with pytest.raises(SystemExit) as exit_code:
        cli.main(
            ["generate", "--ckpt", str(path), *args, "--max-new-tokens", "6", "--batch-size", "1", "--json"]
            + ["--devices", "2", "--expert-model-parallel-size", "2", "--ignore-eod"]
        )
    out = capsys.readouterr()
    assert exit_code.value.code == 0, out.err[-3000:]
    records = [json.loads(line) for line in out.out.splitlines() if line.startswith("{")]
    assert [r["new_tokens"] for r in records] == expected
    # Logits of token batches split the same uneven way (each forward one round of the expert group's).
    loader = torch.utils.data.DataLoader([{"tokens": torch.tensor(p)} for p in prompts], batch_size=1)
    batches = _trainer(2, expert_model_parallel_size=2).predict(module, loader)
    assert len(batches) == len(prompts)
    for got, prompt in zip(batches, prompts):
        torch.testing.assert_close(got, module.full_logits(torch.tensor([prompt])), rtol=1e-5, atol=1e-5)

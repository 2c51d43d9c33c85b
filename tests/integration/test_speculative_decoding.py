"""Speculative decoding end to end: a tiny byte-level GPT trained briefly on the bundled corpus, an EAGLE draft
head trained on it (frozen) with the TrainDraftHead callback through a real Trainer, then speculative greedy
generation on held-out text of the corpus: the same tokens as the base model's greedy ``generate`` for several
prompts and draft lengths, more than one token per base forward, the head saved and reloaded with the base's
fingerprint and refused for another base model, and bad input refused with one clear error."""

from __future__ import annotations

import gzip
import json
import sys
from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

import megatron_lite as ml
from megatron_lite.callbacks import TrainDraftHead
from megatron_lite.core.checkpoint.full.state import gather_full_state, load_full_state
from megatron_lite.core.inference import generate
from megatron_lite.core.inference.speculative import speculative_generate as core_speculative_generate
from megatron_lite.core.models import GPTModel
from megatron_lite.core.models.draft_head import EagleDraftHead, base_fingerprint
from megatron_lite.data import bundled_corpus
from megatron_lite.data.datamodule import PretrainingDataModule
from megatron_lite.data.text_corpus import TokenWindowDataset
from megatron_lite.post_training import load_draft_head, speculative_generate
from megatron_lite.post_training.speculative import DraftHeadExtension, draft_head_of

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from spawn_utils import run_ranks  # noqa: E402

CONFIG = dict(
    num_layers=2,
    hidden_size=64,
    num_attention_heads=4,
    num_query_groups=2,
    vocab_size=256,
    seq_length=64,
    make_vocab_size_divisible_by=64,
)
HELD_OUT = 20_000  # the corpus's last bytes: never trained on


def _corpus_bytes(limit: int = 300_000) -> np.ndarray:
    """The bundled corpus's first ``limit`` bytes as token ids (a byte-level vocabulary: no tokenizer to train)."""
    out = bytearray()
    with gzip.open(bundled_corpus("shakespeare"), "rt", encoding="utf-8") as f:
        for line in f:
            out += json.loads(line)["text"].encode()
            if len(out) >= limit:
                break
    return np.frombuffer(bytes(out[:limit]), dtype=np.uint8).astype(np.int64)


class ByteWindows(PretrainingDataModule):
    def __init__(self, tokens: np.ndarray) -> None:
        super().__init__(seq_length=32, micro_batch_size=16, global_batch_size=16, num_workers=0)
        self.tokens, self.vocab_size = tokens, 256

    def train_dataloader(self):
        return self._loader(TokenWindowDataset(self.tokens, self.seq_length), "train", self._consumed_at_start())


class Metrics(L.Callback):
    def __init__(self) -> None:
        self.accuracy: list[float] = []

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        self.accuracy.append(float(trainer.callback_metrics["train/draft_accuracy"]))


def _fit(module, steps: int, data, callbacks=(), checkpoint_dir=None) -> None:
    if checkpoint_dir is not None:  # one of our DCP checkpoints, written by MegatronStrategy in this process
        callbacks = [*callbacks, ModelCheckpoint(dirpath=checkpoint_dir, filename="last", every_n_train_steps=steps)]
    L.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        logger=False,
        strategy=ml.MegatronStrategy() if checkpoint_dir is not None else "auto",
        enable_checkpointing=checkpoint_dir is not None,
        enable_progress_bar=False,
        enable_model_summary=False,
        limit_val_batches=0,
        callbacks=list(callbacks),
    ).fit(module, data)


def _optimizer() -> ml.OptimizerConfig:
    return ml.OptimizerConfig(lr=3e-3, lr_warmup_iters=10, lr_decay_style="cosine", min_lr=3e-4)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(base module, module whose frozen model carries a trained draft head, its metrics, the saved head file,
    held-out prompts)."""
    torch.manual_seed(0)
    tokens = _corpus_bytes()
    data = ByteWindows(tokens[:-HELD_OUT])
    base = ml.GPTModule(ml.GPTConfig(**CONFIG), _optimizer())
    _fit(base, 100, data)
    module = ml.GPTModule(ml.GPTConfig(**CONFIG), _optimizer())
    module.configure_model()
    module.model.load_state_dict(base.model.state_dict())
    out = tmp_path_factory.mktemp("draft")
    path = out / "draft.safetensors"
    metrics = Metrics()
    _fit(module, 80, data, [TrainDraftHead(save_path=path), metrics], checkpoint_dir=out / "ckpt")
    held = tokens[-HELD_OUT:]
    prompts = [held[i : i + n].tolist() for i, n in zip(range(0, 12_000, 2_000), (16, 5, 24, 9, 1, 30))]
    return base, module, metrics, path, prompts


def test_speculative_output_equals_greedy_with_more_than_one_token_per_base_forward(trained):
    base, module, metrics, _, prompts = trained
    greedy = module.generate(prompts, 24).tokens
    assert greedy == base.generate(prompts, 24).tokens  # the base stayed frozen while the head trained
    for k in (1, 3, 5):
        result = speculative_generate(module, prompts, 24, num_draft_tokens=k)
        assert result.tokens == greedy, f"num_draft_tokens={k}"
        assert sum(result.base_forwards) < sum(len(t) for t in greedy)
        assert result.acceptance_length > 1.0 + 0.2 * min(k, 3), (k, result.acceptance_length)
    # the head learned: its top-1 agreement with the base rose during its short training
    assert np.mean(metrics.accuracy[-10:]) > np.mean(metrics.accuracy[:3]) + 0.2
    # stop ids end a row as in generate (the stop token included)
    stop = greedy[0][3]
    assert (
        speculative_generate(module, prompts, 24, num_draft_tokens=4, stop_ids=[stop]).tokens
        == module.generate(prompts, 24, stop_ids=[stop]).tokens
    )


def test_draft_head_file_keeps_its_base_fingerprint(trained):
    base, module, _, path, prompts = trained
    head = load_draft_head(path, base.model)  # the same weights as the model it was trained on
    assert torch.equal(head.fc.weight, draft_head_of(module.model).fc.weight)
    assert speculative_generate(base, prompts[:2], 12, draft=head).tokens == base.generate(prompts[:2], 12).tokens
    with pytest.raises(ValueError, match="trained for another base model: its weights differ"):
        load_draft_head(path, GPTModel(ml.GPTConfig(**CONFIG), seed=7))
    with pytest.raises(ValueError, match="trained for another base model: its architecture"):
        load_draft_head(path, GPTModel(ml.GPTConfig(**{**CONFIG, "num_layers": 1})))
    # the checkpoint of the draft-head run holds the frozen base and the head: each loads on its own
    checkpoint = path.parent / "ckpt" / "last.ckpt"
    restored = ml.GPTModule.from_pretrained(checkpoint)
    from_checkpoint = load_draft_head(checkpoint, restored.model)
    assert torch.equal(from_checkpoint.layer.mlp.linear_fc1.weight, head.layer.mlp.linear_fc1.weight)
    assert (
        speculative_generate(restored, prompts[:2], 12, draft=from_checkpoint).tokens
        == base.generate(prompts[:2], 12).tokens
    )
    # TrainDraftHead(base=...) (how the CLI names the base) loads it into a fresh module before freezing it
    fresh = ml.GPTModule(ml.GPTConfig(**CONFIG))
    fresh.configure_model()
    fresh.add_objective_extension(DraftHeadExtension(base=checkpoint))
    assert draft_head_of(fresh.model).base == head.base
    assert not any(p.requires_grad for n, p in fresh.model.named_parameters() if not n.startswith("draft_head."))
    wrong = ml.GPTModule(ml.GPTConfig(**{**CONFIG, "num_layers": 1}))
    wrong.configure_model()
    with pytest.raises(ValueError, match="another architecture than the module's config"):
        wrong.add_objective_extension(DraftHeadExtension(base=checkpoint))
    other = GPTModel(ml.GPTConfig(**CONFIG), seed=7)
    with pytest.raises(ValueError, match="trained for another base model: its weights differ"):
        speculative_generate(other, prompts[:1], 4, draft=head)


def _tp2_rank(rank, world_size, base_state, path, prompts):
    layout = ml.ParallelLayout.build(ml.ParallelConfig(tensor_model_parallel_size=2))
    model = GPTModel(ml.GPTConfig(**CONFIG), layout)
    load_full_state(model, base_state, vocab_size=CONFIG["vocab_size"])
    head = load_draft_head(path, model)  # the fingerprint of the TP2 shards is the TP1 model's
    result = core_speculative_generate(model, head, prompts, 16, num_draft_tokens=4)
    return result.tokens, result.base_forwards, generate(model, prompts, 16).tokens


def test_tensor_parallel_speculative_decoding_matches_one_process(trained):
    """Under TP2 (the draft head's layer split like the base's) every rank gets the one-process tokens and the
    same number of base forwards."""
    base, _, _, path, prompts = trained
    state = gather_full_state(base.model, base.model.layout)
    single = speculative_generate(base, prompts, 16, draft=load_draft_head(path, base.model))
    for tokens, forwards, greedy in run_ranks(_tp2_rank, 2, state, str(path), prompts):
        assert tokens == single.tokens == greedy
        assert forwards == single.base_forwards


@pytest.mark.parametrize(
    "variant",
    [
        dict(),
        dict(position_embedding_type="learned_absolute", share_embeddings_and_output_weights=True, num_query_groups=4),
    ],
)
def test_any_draft_head_gives_the_greedy_tokens(variant):
    """Acceptance only changes the speed: an untrained head (random proposals) still gives the greedy tokens,
    for RoPE and learned positions, GQA and tied embeddings."""
    config = ml.GPTConfig(**{**CONFIG, "hidden_size": 32, **variant})
    model = GPTModel(config, seed=3)
    head = EagleDraftHead(config, seed=4)
    head.bind(base_fingerprint(model))
    prompts = [[5, 6, 7, 8, 9, 10], [200], list(range(40, 60))]
    greedy = generate(model, prompts, 16).tokens
    for k in (1, 2, 4):
        result = core_speculative_generate(model, head, prompts, 16, num_draft_tokens=k)
        assert result.tokens == greedy
        assert sum(result.base_forwards) <= sum(len(t) for t in greedy)
    assert core_speculative_generate(model, head, prompts, 0).tokens == [[], [], []]


def test_bad_input_gives_one_clear_error():
    config = ml.GPTConfig(**{**CONFIG, "hidden_size": 32})
    model = GPTModel(config)
    head = EagleDraftHead(config)
    with pytest.raises(ValueError, match="never bound to a base model"):
        core_speculative_generate(model, head, [[1, 2]], 4)
    head.bind(base_fingerprint(model))
    with pytest.raises(ValueError, match="num_draft_tokens must be an integer >= 1"):
        core_speculative_generate(model, head, [[1, 2]], 4, num_draft_tokens=0)
    with pytest.raises(TypeError, match="draft must be an EagleDraftHead"):
        core_speculative_generate(model, model, [[1, 2]], 4)
    with pytest.raises(ValueError, match="past the model's context"):
        core_speculative_generate(model, head, [[1, 2]], 64)
    with pytest.raises(ValueError, match="outside the model's vocabulary"):
        core_speculative_generate(model, head, [[1, 256]], 4)
    with pytest.raises(ValueError, match="Medusa heads are not implemented"):
        TrainDraftHead(kind="medusa")
    with pytest.raises(ValueError, match="unknown draft head kind"):
        TrainDraftHead(kind="tree")
    with pytest.raises(FileNotFoundError, match="no such checkpoint"):
        TrainDraftHead(base="/nonexistent/ckpt")
    with pytest.raises(ValueError, match="no draft head"):
        speculative_generate(model, [[1, 2]], 4)
    with pytest.raises(FileNotFoundError, match="no draft-head file or checkpoint"):
        load_draft_head("/nonexistent/draft.safetensors", model)

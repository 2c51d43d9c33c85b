"""An EAGLE-1 draft head for speculative decoding, and the fingerprint of the base model it was trained for.

EAGLE (Li et al. 2024) drafts in the base model's feature space rather than its token space: at position t
the head reads the base's last hidden state ``f_t`` (after the final norm: what the output layer reads) and
the embedding of the next token ``x_{t+1}``, and predicts ``f_{t+1}``; the base's own (frozen) output layer
turns that into a token. Drafting is autoregressive over the head: its predicted feature and the token it
implies are the next draft step's input. The head is one transformer layer of the base's shape after a
``2h -> h`` projection, so it reuses the base's attention (RoPE, GQA, TP sharding, KV cache) unchanged.

The head remembers which base model it belongs to: two SHA-256 digests, one of the base's architecture
(the config fields that change the function) and one of its weights (full tensors, whatever the TP
layout), held as persistent buffers so that they travel with checkpoints and draft-head files.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from megatron_lite.core.models.config import GPTConfig, refuse_mla
from megatron_lite.core.models.gpt import GPTModel, TransformerLayer
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import gather_full, initialize_parameters, mark_parameter

DRAFT_HEAD_ATTRIBUTE = "draft_head"
"""Name of the draft head as a sub-module of the base GPTModel while it trains (``model.draft_head``)."""

# GPTConfig fields that do not change what a model computes in eval mode (lengths, dropout, init,
# padding, recomputation, the MTP loss's weight): a draft head stays valid when only these differ.
_RUNTIME_FIELDS = frozenset(
    {
        "seq_length",
        "max_position_embeddings",
        "hidden_dropout",
        "attention_dropout",
        "init_method_std",
        "make_vocab_size_divisible_by",
        "recompute_granularity",
        "recompute_method",
        "recompute_num_layers",
        "mtp_loss_scaling_factor",  # weighs a training loss only
    }
)


@dataclass(frozen=True)
class BaseFingerprint:
    """Which base model a draft head belongs to."""

    config: str
    """SHA-256 (hex) of the base's architecture: its GPTConfig without the runtime-only fields."""
    weights: str
    """SHA-256 (hex) of the base's weights: every parameter's full tensor, by name, whatever the layout."""

    def mismatch(self, other: "BaseFingerprint") -> Optional[str]:
        """What differs from ``other`` in words, or None when they are the same base model."""
        if self.config != other.config:
            return "its architecture (GPTConfig) differs"
        if self.weights != other.weights:
            return "its weights differ (same architecture, other values: another run, or the base was trained further)"
        return None


def config_digest(config: GPTConfig) -> str:
    """SHA-256 of the fields of ``config`` that define the function (see ``_RUNTIME_FIELDS``)."""
    fields = {k: v for k, v in dataclasses.asdict(config).items() if k not in _RUNTIME_FIELDS}
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=str).encode()).hexdigest()


@torch.no_grad()
def base_fingerprint(model: GPTModel) -> BaseFingerprint:
    """The fingerprint of ``model`` (a GPTModel; its draft head, if attached, left out).

    Collective over tensor parallelism (each TP-sharded weight is gathered to its full tensor, vocabulary
    padding cut off), so the digest is the same at any TP size; every TP rank must call it."""
    if len(getattr(model, "chunks", [None])) != 1 or not (model.pre_process and model.post_process):
        raise ValueError(
            "a base-model fingerprint needs the whole model on this rank: pipeline parallelism is not "
            "supported for speculative decoding (set pipeline_model_parallel_size=1)"
        )
    group = model.layout.group("tp") if model.layout.tp_size > 1 else None
    digest = hashlib.sha256()
    for name, param in sorted(model.named_parameters()):
        if name.startswith(DRAFT_HEAD_ATTRIBUTE + "."):
            continue
        full = gather_full(param.detach(), getattr(param, "tp_shard", None), group)
        digest.update(f"{name}:{tuple(full.shape)}:{full.dtype}".encode())
        digest.update(full.contiguous().cpu().view(torch.uint8).numpy().tobytes())
    return BaseFingerprint(config=config_digest(model.config), weights=digest.hexdigest())


def _digest_buffer(hex_digest: Optional[str] = None) -> torch.Tensor:
    return torch.tensor(list(bytes.fromhex(hex_digest)) if hex_digest else [0] * 32, dtype=torch.uint8)


class EagleDraftHead(nn.Module):
    """``layer(fc([f_t ; embed(x_{t+1})]))`` -> the predicted feature ``f_{t+1}`` [s, b, h].

    Built for one rank of ``layout`` like the base (its transformer layer is tensor-parallel; ``fc`` is
    replicated). The base's embedding, rotary tables and output layer are passed in, never copied."""

    base_config_digest: torch.Tensor
    base_weights_digest: torch.Tensor

    def __init__(self, config: GPTConfig, layout: Optional[ParallelLayout] = None, seed: int = 1234):
        super().__init__()
        layout = layout or ParallelLayout.single()
        refuse_mla(config, "an EAGLE draft head")  # its speculative decoding caches full keys and values
        if layout.sequence_parallel or layout.cp_size > 1 or layout.pp_size > 1:
            raise ValueError(
                f"an EAGLE draft head runs on whole rows of one pipeline stage: build it with sequence_parallel=False, "
                f"context_parallel_size=1 and pipeline_model_parallel_size=1 (got sp={layout.sequence_parallel}, "
                f"cp={layout.cp_size}, pp={layout.pp_size})"
            )
        h = config.hidden_size
        self.config, self.layout = config, layout
        self.fc = nn.Linear(2 * h, h, bias=False)
        mark_parameter(self.fc.weight, ("normal", config.init_method_std))
        self.layer = TransformerLayer(config, layout)
        self.register_buffer("base_config_digest", _digest_buffer())
        self.register_buffer("base_weights_digest", _digest_buffer())
        initialize_parameters(self, seed)

    @property
    def base(self) -> Optional[BaseFingerprint]:
        """The base model this head was trained for (None before it was bound to one)."""
        if not bool(self.base_weights_digest.any()):
            return None
        return BaseFingerprint(
            bytes(self.base_config_digest.tolist()).hex(), bytes(self.base_weights_digest.tolist()).hex()
        )

    def bind(self, fingerprint: BaseFingerprint) -> None:
        """Record ``fingerprint`` as this head's base model."""
        self.base_config_digest.copy_(_digest_buffer(fingerprint.config))
        self.base_weights_digest.copy_(_digest_buffer(fingerprint.weights))

    def _inputs(self, features: torch.Tensor, token_embeddings: torch.Tensor) -> torch.Tensor:
        return self.fc(torch.cat([features, token_embeddings.to(features.dtype)], dim=-1))

    def forward(self, features: torch.Tensor, token_embeddings: torch.Tensor, rope, rng, context=None) -> torch.Tensor:
        """Training: ``features`` and ``token_embeddings`` [s, b, h] (feature of position t, embedding of token
        t+1) -> predicted features of positions t+1 [s, b, h]; ``rope``/``rng``/``context`` as the base layer's."""
        return self.layer(self._inputs(features, token_embeddings), rope, rng, context)

    @torch.no_grad()
    def inference_forward(self, features: torch.Tensor, token_embeddings: torch.Tensor, rope, kv, step) -> torch.Tensor:
        """One drafting step through the head's KV cache ``kv`` (keys, values); ``rope`` as
        :meth:`GPTModel.inference_forward` builds it and ``step`` an InferenceStep. Returns [s, b, h]."""
        return self.layer.inference_forward(self._inputs(features, token_embeddings), rope, kv, step)

"""Speculative decoding for megatron-lite models: train an EAGLE draft head on a frozen base model through
the one training step (an objective extension), save and load it with the base model's fingerprint, and
generate with it.

ModelOpt's ``modelopt.torch.speculative`` (EAGLE, Medusa) converts Hugging Face ``PreTrainedModel``s and
Megatron-Core ``GPTModel``s only (its Megatron plugin imports ``megatron.core``), so the head here is our
own: :class:`~megatron_lite.core.models.draft_head.EagleDraftHead`, built from our tensor-parallel layers.

Training objective (EAGLE-1): with the base's features ``f`` (final-norm output) and its greedy tokens
``g`` (``argmax`` of its logits), the head's prediction ``p_t`` from ``(f_t, x_{t+1})`` is pulled towards
``f_{t+1}`` (smooth L1, weight ``regression_weight``) and the base's output layer applied to ``p_t`` is
trained to give ``g_{t+1}`` (cross entropy, weight ``classification_weight``). Greedy speculative decoding
accepts a proposal exactly when it equals the base's greedy token, so the classification target is the
base's choice, not the data's next token.
"""

from __future__ import annotations

import dataclasses
import json
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.checkpoint.format.safetensors_io import load_safetensors, save_safetensors
from megatron_lite.core.checkpoint.full.reader import MODEL_PREFIX, is_checkpoint_directory, read_model_tensors
from megatron_lite.core.checkpoint.full.state import (
    carry_over_state,
    gather_full_state,
    holds_distinct_piece,
    load_full_state,
)
from megatron_lite.core.engine.extensions import ObjectiveExtension
from megatron_lite.core.inference.speculative import SpeculativeResult, check_draft
from megatron_lite.core.inference.speculative import speculative_generate as _speculative_generate
from megatron_lite.core.models.draft_head import (
    DRAFT_HEAD_ATTRIBUTE,
    BaseFingerprint,
    EagleDraftHead,
    base_fingerprint,
    config_digest,
)
from megatron_lite.core.models.mtp import MTPLayer, mtp_draft
from megatron_lite.core.object_staging import local_input
from megatron_lite.core.object_store import Location, is_file, is_remote, location, upload
from megatron_lite.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.loss_report import report_entry
from megatron_lite.core.parallel.vocab_padding import gather_real_vocab

FORMAT = "megatron-lite-draft-head/1"
DRAFT_KINDS = ("eagle",)


@dataclass
class DraftHeadConfig:
    """How a draft head is built and trained."""

    kind: str = "eagle"
    """Draft model: "eagle" (one transformer layer over the base's features; Medusa heads are not built yet)."""
    regression_weight: float = 1.0
    """Weight of the smooth-L1 loss between the predicted and the base's next feature (EAGLE: 1.0)."""
    classification_weight: float = 0.1
    """Weight of the cross entropy of the predicted feature's token against the base's greedy token (EAGLE: 0.1)."""
    seed: int = 1234
    """Seed of the head's initial weights (drawn per parameter name, so the same at any TP size)."""

    def __post_init__(self) -> None:
        if self.kind == "medusa":
            raise ValueError(
                "kind='medusa': Medusa heads are not implemented; use kind='eagle' (an EAGLE-1 draft "
                "head, which also accepts more tokens per step than Medusa in the EAGLE paper)"
            )
        if self.kind not in DRAFT_KINDS:
            raise ValueError(f"unknown draft head kind {self.kind!r}; choose one of {list(DRAFT_KINDS)}")
        for name in ("regression_weight", "classification_weight"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value >= 0:
                raise ValueError(f"{name} must be a number >= 0, got {value!r}")
        if self.regression_weight == 0 and self.classification_weight == 0:
            raise ValueError(
                "regression_weight and classification_weight are both 0: nothing would be trained; "
                "keep EAGLE's 1.0 and 0.1"
            )
        if isinstance(self.seed, bool) or not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed must be an integer >= 0, got {self.seed!r}")


def draft_head_of(model: nn.Module) -> Optional[EagleDraftHead]:
    """The draft head attached to ``model`` (a GPTModel) by :class:`DraftHeadExtension`, or None."""
    head = getattr(model, DRAFT_HEAD_ATTRIBUTE, None)
    return head if isinstance(head, EagleDraftHead) else None


def restore_draft_head(model: nn.Module, state: dict[str, torch.Tensor], prefix: str = "") -> bool:
    """If ``state`` (full tensors keyed ``prefix`` + the model's names) holds a draft head and ``model`` (a GPTModel)
    has none, attach an untrained one built for ``model``'s layout, for the state's tensors (its weights and its
    base's fingerprint) to be loaded into: how the head a forked fit trained reaches the launching process.
    Returns whether it attached one."""
    head_prefix = prefix + DRAFT_HEAD_ATTRIBUTE + "."
    if draft_head_of(model) is not None or not any(name.startswith(head_prefix) for name in state):
        return False
    head = EagleDraftHead(model.config, model.layout).to(next(model.parameters()).device)
    model.add_module(DRAFT_HEAD_ATTRIBUTE, head)
    return True


class DraftHeadExtension(ObjectiveExtension):
    """Replace a GPT module's objective by an EAGLE draft head's: ``attach`` freezes every base parameter and
    adds the head as ``model.draft_head`` (trainable, saved in the module's checkpoints with the base's
    fingerprint); each microbatch runs the frozen base without gradients, then the head."""

    def __init__(self, config: Optional[DraftHeadConfig] = None, base: Optional[str | os.PathLike] = None) -> None:
        """``base``: load the base model's weights from there (one of our checkpoints or a Hugging Face
        directory, read by ``from_pretrained``) before freezing it; None keeps the module's own weights."""
        self.config = config if config is not None else DraftHeadConfig()
        self.base = base
        self.model: Optional[nn.Module] = None

    def attach(self, module: Any, model: nn.Module, layout: ParallelLayout) -> None:
        if layout.pp_size > 1 or layout.cp_size > 1 or layout.sequence_parallel:
            raise ValueError(
                f"TrainDraftHead needs whole rows of the whole model on each rank: set "
                f"pipeline_model_parallel_size=1, context_parallel_size=1 and sequence_parallel=False (got "
                f"pp={layout.pp_size}, cp={layout.cp_size}, sp={layout.sequence_parallel}); TP and DP are fine"
            )
        if getattr(model, "output_layer", None) is None:
            raise ValueError(
                "TrainDraftHead needs a base model with an output layer (a language model, not a reward model)"
            )
        if self.base is not None and draft_head_of(model) is None:
            _load_base(module, model, self.base)
        fingerprint = base_fingerprint(model)
        head = draft_head_of(model)
        if head is None:
            head = EagleDraftHead(model.config, layout, seed=self.config.seed).to(next(model.parameters()).device)
        elif head.base is not None and head.base.mismatch(fingerprint) is not None:
            raise ValueError(
                f"the model already holds a draft head trained for another base model "
                f"({head.base.mismatch(fingerprint)}); build the module afresh"
            )
        for param in model.parameters():
            param.requires_grad_(False)
        head.bind(fingerprint)
        model.add_module(DRAFT_HEAD_ATTRIBUTE, head)  # after freezing: the head's parameters stay trainable
        self.model = model

    def forward_step(self, inner, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> Any:
        model = self.model
        head = draft_head_of(model)
        tokens = microbatch["tokens"]
        inputs, labels = (tokens, microbatch["labels"]) if "labels" in microbatch else (tokens[:, :-1], tokens[:, 1:])
        positions = microbatch.get("position_ids")
        cu_seqlens = microbatch.get("cu_seqlens")
        with torch.no_grad():
            features, base_logits = _base_forward(model, inputs, positions, cu_seqlens)  # [s, b, h], [s, b, V/tp]
            greedy = self._argmax(base_logits)  # [s, b]: the base's next token
            weight = model.embedding.weight if model.config.share_embeddings_and_output_weights else None
            embeddings = model.embedding(labels.t())  # token t+1, the head's second input at position t
            rope = (
                model.rotary(
                    positions if positions is not None else torch.arange(inputs.shape[1], device=inputs.device)
                )
                if model.rotary
                else None
            )
        predicted = head(features, embeddings, rope, model.rng_tracker, model.attention_context(cu_seqlens))
        predicted, target = predicted[:-1], features[1:]  # position t predicts position t+1
        regression = F.smooth_l1_loss(predicted.float(), target.float(), reduction="none").mean(dim=-1)
        logits = model.output_layer(predicted, weight)  # [s-1, b, V_padded/tp]; frozen, gradient flows through
        classification = vocab_parallel_cross_entropy(
            logits, greedy[1:], model.tp_group, model.vocab_start, model.config.vocab_size
        )
        with torch.no_grad():
            correct = (self._argmax(logits.detach()) == greedy[1:]).to(torch.float64)
        cfg = self.config
        per_token = cfg.regression_weight * regression + cfg.classification_weight * classification
        return per_token.t(), regression.t().detach(), classification.t().detach(), correct.t()

    def _argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Greedy tokens of this TP rank's logits [s, b, V_padded/tp] over the whole real vocabulary [s, b]."""
        model = self.model
        return gather_real_vocab(logits.float(), model.tp_group, model.config.vocab_size).argmax(dim=-1)

    def loss(self, inner, output: Any, microbatch: dict) -> tuple:
        """(the head's loss summed over its tokens, their number); a training step also reports the draft's
        regression and classification losses and accuracy (its greedy token equal to the base's) per token."""
        per_token, regression, classification, correct = output
        mask = microbatch.get("loss_mask")
        # position t is trained only where the next position is a real token of the row
        mask = torch.ones_like(per_token) if mask is None else mask[:, 1:].to(per_token.dtype)
        count = mask.sum()
        if not per_token.requires_grad:  # evaluation runs forward only: its loss is val/loss
            return (per_token * mask).sum(), count
        report = {
            name: report_entry((value * mask).sum(), count)
            for name, value in (
                ("draft_regression_loss", regression),
                ("draft_classification_loss", classification),
                ("draft_accuracy", correct),
            )
        }
        return (per_token * mask).sum(), count, report


def _load_base(module: Any, model: nn.Module, path: str | os.PathLike) -> None:
    """The weights of ``path`` into ``model`` (built for any layout: each rank cuts its shard out of a one-process
    copy), refused when the saved model has another architecture than ``model``'s config."""
    loaded = type(module).from_pretrained(path)
    if config_digest(loaded.config) != config_digest(model.config):
        theirs, ours = dataclasses.asdict(loaded.config), dataclasses.asdict(model.config)
        differ = {k: (theirs[k], ours[k]) for k in ours if theirs.get(k) != ours[k]}
        raise ValueError(
            f"TrainDraftHead(base={str(path)!r}) holds a model of another architecture than the module's "
            f"config (saved vs module: {differ}); build the module with the checkpoint's GPTConfig"
        )
    carry_over_state(loaded.model, model, vocab_size=model.config.vocab_size)


def _base_forward(model: nn.Module, inputs: torch.Tensor, positions, cu_seqlens) -> tuple[torch.Tensor, torch.Tensor]:
    """The base's final-norm output [s, b, h] and this TP rank's logits [s, b, V_padded/tp] for ``inputs``
    [b, s]: the model's own forward, its final norm's output read off by a hook."""
    captured: list[torch.Tensor] = []
    hook = model.final_layernorm.register_forward_hook(lambda _module, _args, out: captured.append(out))
    # The frozen base runs in eval mode (no dropout: its features are the ones generation will see); the head
    # keeps its own mode.
    base_modules = [m for name, m in model.named_modules() if not name.startswith(DRAFT_HEAD_ATTRIBUTE)]
    modes = [m.training for m in base_modules]
    try:
        for m in base_modules:
            m.training = False
        logits = model(inputs, position_ids=positions, cu_seqlens=cu_seqlens)
    finally:
        hook.remove()
        for m, mode in zip(base_modules, modes):
            m.training = mode
    return captured[-1], logits.transpose(0, 1)


# --- draft-head files -----------------------------------------------------------------------------
def save_draft_head(draft: EagleDraftHead, path: str | os.PathLike) -> Optional[Location]:
    """Write ``draft`` (full tensors, whatever its TP layout) with its base model's fingerprint to one
    safetensors file, atomically (at an ``s3://`` URL: written locally, then one upload, which readers see whole or
    not at all). Collective over TP: every rank of the replica calls it; the first writes.
    Returns the path on the writing rank, None elsewhere."""
    if not isinstance(draft, EagleDraftHead):
        raise TypeError(f"draft must be an EagleDraftHead, got {type(draft).__name__}")
    if draft.base is None:
        raise ValueError(
            "the draft head was never bound to a base model (untrained): train it with TrainDraftHead first"
        )
    state = gather_full_state(draft, draft.layout)
    if not holds_distinct_piece(draft.layout):
        return None
    meta = {
        "format": FORMAT,
        "kind": "eagle",
        "base_config_sha256": draft.base.config,
        "base_weights_sha256": draft.base.weights,
        "gpt_config": json.dumps(dataclasses.asdict(draft.config)),
    }
    if is_remote(path):
        with tempfile.TemporaryDirectory(prefix="megatron-lite-draft-") as folder:
            local = Path(folder) / "draft_head.safetensors"
            save_safetensors(state, local, metadata=meta)
            upload(str(local), str(location(path)))
        return location(path)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_safetensors(state, path, metadata=meta)
    return path


def load_draft_head(path: str | os.PathLike, model: nn.Module) -> EagleDraftHead:
    """The draft head saved at ``path`` (a :func:`save_draft_head` file, or one of our checkpoints written while
    TrainDraftHead trained), built for ``model``'s layout (each TP rank keeps its shard), after
    checking that it was trained for ``model`` (same architecture and weights): else one ValueError. At an ``s3://``
    URL a file is read from a local copy (cached by its ETag), a checkpoint where it is (its commit marker followed)."""
    prefix = MODEL_PREFIX + DRAFT_HEAD_ATTRIBUTE + "."
    if is_remote(path) and not is_file(os.fspath(path)):
        tensors = read_model_tensors(path, prefix=prefix)  # one error naming the URL when no checkpoint is there
    else:
        path = Path(local_input(path))
        if is_checkpoint_directory(path):
            tensors = read_model_tensors(path, prefix=prefix)
        elif path.is_file():
            tensors, meta = load_safetensors(path)
            if meta.get("format") != FORMAT:
                raise ValueError(
                    f"{path} is not a megatron-lite draft-head file (format {meta.get('format')!r}, expected "
                    f"{FORMAT!r})"
                )
        else:
            raise FileNotFoundError(
                f"no draft-head file or checkpoint at {path}; write one with save_draft_head(...), "
                f"TrainDraftHead(save_path=...) or a checkpoint of a TrainDraftHead run"
            )
    if "base_config_digest" not in tensors:
        raise ValueError(
            f"{path} holds no draft head (no {prefix}* tensors): give the file TrainDraftHead(save_path=...) wrote, "
            f"or a checkpoint of a TrainDraftHead run"
        )
    saved = BaseFingerprint(
        bytes(tensors["base_config_digest"].tolist()).hex(), bytes(tensors["base_weights_digest"].tolist()).hex()
    )
    problem = saved.mismatch(base_fingerprint(model))
    if problem is not None:
        raise ValueError(
            f"the draft head in {path} was trained for another base model: {problem}. Load it with the "
            f"model it was trained on, or train a draft head for this one with TrainDraftHead"
        )
    head = EagleDraftHead(model.config, model.layout).to(next(model.parameters()).device)
    params = dict(head.named_parameters())
    for name, tensor in tensors.items():  # a checkpoint keeps fused blocks in their blocked shape ([2, ffn, h])
        shape = getattr(getattr(params.get(name), "tp_shard", None), "global_shape", None)
        if shape is not None and tensor.shape != torch.Size(shape) and tensor.numel() == torch.Size(shape).numel():
            tensors[name] = tensor.reshape(shape)
    load_full_state(head, tensors)
    head.eval()
    return head


def speculative_generate(
    module_or_model: Any,
    prompts: Any,
    max_new_tokens: int,
    *,
    draft: Optional[EagleDraftHead | MTPLayer] = None,
    num_draft_tokens: int = 4,
    stop_ids: Optional[Any] = None,
) -> SpeculativeResult:
    """Greedy speculative decoding with a GPTModule (or GPTModel) and its draft head: ``draft`` defaults to the
    one :class:`~megatron_lite.callbacks.TrainDraftHead` attached (``model.draft_head``), else to the model's first
    multi-token prediction depth (a model with ``mtp_num_layers``). The tokens equal the
    module's greedy ``generate``; ``result.acceptance_length`` is tokens per base forward. See
    :func:`megatron_lite.core.inference.speculative.speculative_generate`."""
    model = getattr(module_or_model, "model", module_or_model)
    if model is None and hasattr(module_or_model, "configure_model"):
        module_or_model.configure_model()
        model = module_or_model.model
    draft = draft if draft is not None else draft_head_of(model)
    if draft is None and getattr(model, "mtp", None) is not None:
        draft = mtp_draft(model)
    if draft is None:
        raise ValueError(
            "no draft head: pass draft=load_draft_head(path, model), train one with "
            "megatron_lite.callbacks.TrainDraftHead, or use a model with mtp_num_layers (it drafts with its MTP depth)"
        )
    return _speculative_generate(
        model, draft, prompts, max_new_tokens, num_draft_tokens=num_draft_tokens, stop_ids=stop_ids
    )


__all__ = [
    "DraftHeadConfig",
    "DraftHeadExtension",
    "SpeculativeResult",
    "check_draft",
    "draft_head_of",
    "load_draft_head",
    "save_draft_head",
    "speculative_generate",
]

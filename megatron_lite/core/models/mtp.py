"""Multi-token prediction (DeepSeek-V3; megatron-core's ``MultiTokenPredictionBlock``).

Depth ``k`` (1..D) predicts the token ``k + 1`` ahead of each position: ``h_k = norm_k(layer_k(eh_proj([enorm(
Emb(tokens shifted by k)); hnorm(h_{k-1})])))``, with ``h_0`` the main model's final-norm output, its logits through
the model's own (shared) output layer and embedding. Its loss is the cross-entropy against the labels shifted by k
more, masked like the main loss (a position whose target lies past the row's end, or in the next packed document,
counts zero). The MTP loss ``mtp_loss_scaling_factor / D x sum_k (masked sum of depth k's per-token losses)`` joins
the objective as Megatron's per-token loss does: it is back-propagated with the engine's multiplier of the main
summed loss (so the engine divides it by the same global token count) and reported as ``mtp_loss`` (its sum over
the main loss's tokens), while the main loss's value stays the next-token loss. The block sits on the last
pipeline stage, next to the output layer it shares. Under context parallelism a rank holds a zigzag share of the rows
and a shift crosses chunks: the tokens, labels, mask and positions are gathered into whole rows over CP, shifted
there and cut back (the hidden states are position-aligned and stay local; the depths' attention is context-parallel
like the decoder's).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable, Optional

import torch
from torch import nn

from megatron_lite.core.models.moe.aux_loss import attach_aux_loss
from megatron_lite.core.models.moe.step_state import MoEStepState
from megatron_lite.core.models.mtp_config import mtp_depth
from megatron_lite.core.models.norms import Norm
from megatron_lite.core.models.recompute import checkpoint, recompute_active
from megatron_lite.core.parallel.context_parallel import rank_share
from megatron_lite.core.parallel.context_parallel_rows import gather_whole_rows
from megatron_lite.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import scatter_to_sequence_parallel_region
from megatron_lite.core.parallel.tensor_parallel import ColumnParallelLinear

if TYPE_CHECKING:
    from megatron_lite.core.models.config import GPTConfig
    from megatron_lite.core.models.gpt import GPTModel, TransformerLayer

MTP_LOSS = "mtp_loss"
"""The report name of the MTP loss (logged as ``train/mtp_loss``)."""


def shifted_left(x: torch.Tensor, k: int, fill: float = 0) -> torch.Tensor:
    """``x`` [b, s] moved k positions to the left along the sequence (``out[:, t] = x[:, t + k]``), ``fill`` past
    the end."""
    out = torch.full_like(x, fill)
    out[:, : x.shape[1] - k] = x[:, k:]
    return out


def depth_mask(
    loss_mask: Optional[torch.Tensor], labels: torch.Tensor, position_ids: Optional[torch.Tensor], k: int
) -> torch.Tensor:
    """Which positions depth k is scored at [b, s] (float): those whose target ``labels[t + k]`` exists in the row,
    in the same packed document (positions restart at 0 per document), and is scored by the main loss."""
    mask = shifted_left(torch.ones_like(labels, dtype=torch.float32), k)
    if loss_mask is not None:
        mask = mask * shifted_left(loss_mask.to(torch.float32), k)
    if position_ids is not None:
        same_document = shifted_left(position_ids, k, fill=-1) == position_ids + k
        mask = mask * same_document.to(torch.float32)
    return mask


def depth_inputs(
    tokens: torch.Tensor,
    labels: torch.Tensor,
    loss_mask: Optional[torch.Tensor],
    position_ids: Optional[torch.Tensor],
    depth: int,
    context_parallel: Optional[ParallelLayout] = None,
) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """For each depth k = 1..``depth``: the input tokens and the targets shifted k to the left along the rows, and
    the depth's mask (:func:`depth_mask`), all [b, s]. Under ``context_parallel`` (the layout of a CP run) the
    arguments are this rank's zigzag share [b, s/C] of the rows: a shift crosses into other ranks' chunks, so the
    shares are gathered into whole rows (once for every depth), shifted there, and this rank's share cut out again."""
    rows = [tokens, labels]
    if loss_mask is not None:
        rows.append(loss_mask)
    if position_ids is not None:
        rows.append(position_ids)
    if context_parallel is not None:
        rows = gather_whole_rows(rows, context_parallel.group("cp"))

    def share(x: torch.Tensor) -> torch.Tensor:
        if context_parallel is None:
            return x
        return rank_share(x, context_parallel.cp_size, context_parallel.cp_rank)

    tokens, labels = rows[0], rows[1]
    loss_mask = rows[2] if loss_mask is not None else None
    position_ids = rows[-1] if position_ids is not None else None
    return [
        (
            share(shifted_left(tokens, k)),
            share(shifted_left(labels, k)),
            share(depth_mask(loss_mask, labels, position_ids, k)),
        )
        for k in range(1, depth + 1)
    ]


class MTPLayer(nn.Module):
    """One depth: the norms of its two inputs, their projection back to the hidden width, a transformer layer of the
    model's kind (MoE where the model's last layer is) and its own final norm (DeepSeek's ``shared_head.norm``)."""

    def __init__(self, config: "GPTConfig", layout: ParallelLayout, transformer_layer: "TransformerLayer"):
        super().__init__()
        sp, h = layout.sequence_parallel, config.hidden_size
        self.enorm = Norm(config.normalization, h, config.layernorm_epsilon, sp)
        self.hnorm = Norm(config.normalization, h, config.layernorm_epsilon, sp)
        # column-parallel and gathered (megatron-core's eh_proj): whole rows of the full width leave it on every rank
        self.eh_proj = ColumnParallelLinear(
            2 * h, h, layout, bias=False, gather_output=True, init_std=config.init_method_std
        )
        self.transformer_layer = transformer_layer
        self.final_layernorm = Norm(config.normalization, h, config.layernorm_epsilon, sp)
        self.tp_group = layout.group("tp")
        self.sequence_parallel = sp

    def forward(self, hidden: torch.Tensor, embedded: torch.Tensor, rope, rng, context) -> torch.Tensor:
        """``hidden`` h_{k-1} and ``embedded`` (the shifted tokens' embeddings), both [s(/tp), b, h] -> h_k."""
        x = self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(hidden)], dim=-1))
        if self.sequence_parallel:
            x = scatter_to_sequence_parallel_region(x, self.tp_group)
        return self.final_layernorm(self.transformer_layer(x, rope, rng, context))

    def inference_forward(self, features: torch.Tensor, token_embeddings: torch.Tensor, rope, kv, step) -> torch.Tensor:
        """The same depth for generation (eval, sequence parallelism off), attention through the KV cache ``kv``:
        as a speculative-decoding draft it reads the model's final-norm ``features`` [s, b, h] and the next tokens'
        embeddings, and returns its own features, which the shared output layer turns into the token after."""
        x = self.eh_proj(torch.cat([self.enorm(token_embeddings), self.hnorm(features)], dim=-1))
        return self.final_layernorm(self.transformer_layer.inference_forward(x, rope, kv, step))


def mtp_draft(model: "GPTModel") -> MTPLayer:
    """The model's first MTP depth, as a speculative-decoding draft (``speculative_generate(model, mtp_draft(model),
    ...)``): it predicts the token after next from the model's features, as DeepSeek-V3 drafts with it."""
    if model.mtp is None:
        raise ValueError(
            "this model has no multi-token prediction block to draft with: build it with mtp_num_layers >= 1 (on its "
            "last pipeline stage, with its output layer), or draft with an EAGLE head"
        )
    return model.mtp.depths()[0]


class MultiTokenPrediction(nn.Module):
    """The D MTP depths of a model's last stage; ``layers`` keyed by global layer number (after the decoder's), as
    DeepSeek-V3 checkpoints number them. ``transformer_layer`` builds a depth's layer from its global number (the
    model's builder: a layer of the model's kind, MoE where its last layer is, sharing ``step_state``)."""

    def __init__(
        self,
        config: "GPTConfig",
        layout: ParallelLayout,
        step_state: MoEStepState,
        transformer_layer: Callable[[int], "TransformerLayer"],
    ):
        super().__init__()
        numbers = range(config.num_layers, config.num_layers + mtp_depth(config))
        self.layers = nn.ModuleDict({str(i): MTPLayer(config, layout, transformer_layer(i)) for i in numbers})
        self.scale = config.mtp_loss_scaling_factor / mtp_depth(config)
        self.step_state = step_state

    def depths(self) -> list[MTPLayer]:
        """The depths in order (k = 1..D)."""
        return [layer for _, layer in sorted(self.layers.items(), key=lambda item: int(item[0]))]  # type: ignore[misc]

    def per_token_losses(
        self,
        model: "GPTModel",
        hidden: torch.Tensor,
        inputs: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]],
        rope,
        context,
    ) -> list[torch.Tensor]:
        """Each depth's per-token loss [b, s] (unmasked), from the main model's final-norm output ``hidden``
        [s(/tp), b, h] and each depth's shifted tokens and targets (:func:`depth_inputs`). Under 'full' recompute
        every depth's layer (its norms, projection and transformer layer: megatron-core's checkpointed MTP layer)
        is rebuilt in the backward pass, its dropout streams replayed as the decoder's layers' are."""
        assert model.embedding is not None and model.output_layer is not None  # built with the block
        recompute = model.config.recompute_granularity == "full" and recompute_active(model)
        rng = model.rng_tracker
        losses = []
        for layer, (tokens, target, _) in zip(self.depths(), inputs):
            embedded = model.embedding(tokens.t())
            if recompute:
                hidden = checkpoint(layer, hidden, embedded, rope, rng, context, rng_tracker=rng)
            else:
                hidden = layer(hidden, embedded, rope, rng, context)
            logits = model.output_layer(hidden, model._output_weight())
            loss = vocab_parallel_cross_entropy(
                logits, target.t(), model.tp_group, model.vocab_start, model.config.vocab_size
            )
            losses.append(loss.t())
        return losses

    def attach_loss(
        self,
        model: "GPTModel",
        main_loss: torch.Tensor,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        labels: torch.Tensor,
        loss_mask: Optional[torch.Tensor],
        position_ids: Optional[torch.Tensor],
        rope,
        context,
    ) -> torch.Tensor:
        """``main_loss`` [b, s] unchanged, carrying the MTP loss into its backward (with the engine's multiplier of
        the summed main loss); the MTP loss and the main loss's token count are recorded for the step's report (and
        summed over CP by the engine with the main loss's)."""
        cp = model.layout if model.context_parallel else None
        inputs = depth_inputs(tokens, labels, loss_mask, position_ids, len(self.layers), cp)
        total = sum(
            (
                (loss * mask.to(loss.dtype)).sum()
                for loss, (_, _, mask) in zip(self.per_token_losses(model, hidden, inputs, rope, context), inputs)
            ),
            start=torch.zeros((), dtype=main_loss.dtype, device=main_loss.device),
        )
        total = total * self.scale
        count = loss_mask.sum() if loss_mask is not None else float(labels.numel())
        self.step_state.record(MTP_LOSS, total.detach(), count)
        return attach_aux_loss(main_loss, total, self.step_state.backward_scale)

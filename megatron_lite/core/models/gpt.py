"""GPTModel: embedding, a stack of pre-norm transformer layers, and a vocab-parallel output layer.

Activations flow as ``[s, b, h]`` (``[s/tp, b, h]`` under sequence parallelism) like Megatron, so
the sequence split is a contiguous slice. Layers are keyed by their global index, so parameter
names do not depend on the layout.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Optional, cast

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.models.attention import SelfAttention, rotary_tables, scaled_init_std
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.mla import MultiLatentAttention
from megatron_lite.core.models.mlp import MLP
from megatron_lite.core.models.moe.step_state import MoEStepState
from megatron_lite.core.models.moe_config import check_moe_parallelism, moe_layer_pattern
from megatron_lite.core.models.mtp import MultiTokenPrediction
from megatron_lite.core.models.mtp_config import mtp_depth
from megatron_lite.core.models.norms import Norm
from megatron_lite.core.models.recompute import checkpoint, full_recompute_groups, recompute_active
from megatron_lite.core.models.rope import RotaryEmbedding
from megatron_lite.core.parallel.context_parallel import AttentionContext
from megatron_lite.core.parallel.cross_entropy import vocab_parallel_cross_entropy
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import scatter_to_sequence_parallel_region
from megatron_lite.core.parallel.pipeline_stages import StageChunk
from megatron_lite.core.parallel.random import (
    DATA_PARALLEL_RNG,
    MODEL_PARALLEL_RNG,
    RNGStatesTracker,
    model_parallel_rng_tracker,
)
from megatron_lite.core.parallel.tensor_parallel import (
    ColumnParallelLinear,
    VocabParallelEmbedding,
    initialize_parameters,
    mark_parameter,
)
from megatron_lite.core.parallel.vocab_padding import gather_real_vocab, mask_vocab_padding


def hidden_dropout(
    x: torch.Tensor, p: float, training: bool, sequence_parallel: bool, rng: RNGStatesTracker
) -> torch.Tensor:
    """Dropout on residual-stream activations.

    Under SP each TP rank holds a different slice of the sequence and draws its own mask (the
    model-parallel stream); otherwise the activations are replicated over TP and every TP rank
    must draw the same mask (the data-parallel stream).
    """
    if not training or p == 0.0:
        return x
    with rng.fork(MODEL_PARALLEL_RNG if sequence_parallel else DATA_PARALLEL_RNG, x.device):
        return F.dropout(x, p, training=True)


class TransformerLayer(nn.Module):
    """Pre-norm block: ``x + attn(norm(x))`` then ``x + mlp(norm(x))``; the MLP is an MoE layer where
    ``moe_layer_freq`` says so, or ``moe`` (a layer outside the decoder: MTP's) (``moe_state``: the model's, shared
    by its MoE layers)."""

    def __init__(
        self,
        config: GPTConfig,
        layout: ParallelLayout,
        layer_number: int = 0,
        moe_state: Optional[MoEStepState] = None,
        moe: Optional[bool] = None,
    ):
        super().__init__()
        sp = layout.sequence_parallel
        out_std = scaled_init_std(config)
        self.input_layernorm = Norm(config.normalization, config.hidden_size, config.layernorm_epsilon, sp)
        self.self_attention: SelfAttention | MultiLatentAttention
        if config.multi_latent_attention:
            self.self_attention = MultiLatentAttention(config, layout, out_std)
        else:
            self.self_attention = SelfAttention(config, layout, out_std)
        self.pre_mlp_layernorm = Norm(config.normalization, config.hidden_size, config.layernorm_epsilon, sp)
        self.mlp: nn.Module
        if moe_state is not None and (moe_layer_pattern(config)[layer_number] if moe is None else moe):
            from megatron_lite.core.models.moe.layer import MoELayer

            self.mlp = MoELayer(config, layout, layer_number, out_std, moe_state)
        else:
            self.mlp = MLP(config, layout, out_std)
        self.hidden_dropout = config.hidden_dropout
        self.sequence_parallel = sp

    def _dropout(self, x: torch.Tensor, rng: RNGStatesTracker) -> torch.Tensor:
        return hidden_dropout(x, self.hidden_dropout, self.training, self.sequence_parallel, rng)

    def forward(self, x, rope, rng, context=None):
        x = x + self._dropout(self.self_attention(self.input_layernorm(x), rope, rng, context), rng)
        return x + self._dropout(self.mlp(self.pre_mlp_layernorm(x)), rng)

    def inference_forward(self, x, rope, kv, step):
        """The same block for generation (eval: no dropout), attention through the KV cache."""
        x = x + self.self_attention.inference_forward(self.input_layernorm(x), rope, kv, step)
        return x + self.mlp(self.pre_mlp_layernorm(x))


def _run_layers(
    layers: list[TransformerLayer], x: torch.Tensor, rope, rng: RNGStatesTracker, context: Optional[AttentionContext]
) -> torch.Tensor:
    for layer in layers:
        x = layer(x, rope, rng, context)
    return x


class ModelChunk:
    """One (virtual) pipeline stage of a :class:`GPTModel`: calling it runs that chunk's layers (with
    the embedding on the first stage, the output layer and loss on the last).

    Deliberately not a registered submodule: parameter names stay those of the whole model (layers
    keyed by their global index), whatever the cut, so checkpoints and the optimizer see one model.
    """

    def __init__(self, model: "GPTModel", index: int, stage: StageChunk):
        self.model, self.index, self.stage = model, index, stage

    @property
    def pre_process(self) -> bool:
        """Whether this chunk embeds the tokens (it takes no activations from a previous stage)."""
        return self.stage.pre_process

    @property
    def post_process(self) -> bool:
        """Whether this chunk ends the model (output layer and loss; it sends nothing onward)."""
        return self.stage.post_process

    def __call__(
        self,
        tokens: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        *,
        hidden_states: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        loss_mask: Optional[torch.Tensor] = None,
        with_mtp: bool = True,
    ) -> torch.Tensor:
        return self.model(
            tokens,
            labels,
            position_ids=position_ids,
            cu_seqlens=cu_seqlens,
            hidden_states=hidden_states,
            chunk=self.index,
            loss_mask=loss_mask,
            with_mtp=with_mtp,
        )

    @property
    def mtp(self) -> Optional[MultiTokenPrediction]:
        """The model's multi-token prediction block, where this chunk ends the model (it takes the loss mask)."""
        return self.model.mtp if self.post_process else None

    def __repr__(self) -> str:
        return f"ModelChunk(virtual_stage={self.stage.virtual_stage}, layers={self.stage.layers})"


class GPTModel(nn.Module):
    """A decoder-only transformer built for one rank of ``layout``.

    ``forward(tokens)`` returns this rank's logits ``[b, s, V_padded/tp]`` (the vocabulary padding's are
    -inf); ``forward(tokens, labels)`` returns the per-token loss ``[b, s]`` (identical on every TP rank).
    The padding never changes the function: its rows are zero, outside every softmax, and the real rows are
    drawn from the seed as an unpadded model's are, so the same seed is the same model at any TP size. Under pipeline
    parallelism the rank holds only its stages' layers (``self.chunks``, one per virtual stage); a chunk that is not
    the last returns its activations ``[s(/tp), b, h]`` for the next stage.
    ``output_layer=False`` leaves out the vocabulary projection: the last stage then returns the final
    norm's output ``[s(/tp), b, h]`` (for objectives with their own head, e.g. a reward model).
    """

    def __init__(
        self, config: GPTConfig, layout: Optional[ParallelLayout] = None, seed: int = 1234, output_layer: bool = True
    ):
        super().__init__()
        layout = layout or ParallelLayout.single()
        if config.num_moe_experts is not None:  # a dense model (a teacher, a reference) runs under any expert layout
            check_moe_parallelism(config, layout.config, sequence_parallel=True)  # SP is the training check's business
        if layout.cp_size > 1 and config.attention_dropout > 0.0:
            raise ValueError(
                f"attention_dropout={config.attention_dropout} with context_parallel_size={layout.cp_size}: the "
                f"context-parallel attention has no dropout; set attention_dropout=0.0 or context_parallel_size=1"
            )
        config.validate_parallelism(layout.tp_size, layout.pp_size, layout.cp_size, layout.sequence_parallel)
        self.config, self.layout, self.seed = config, layout, seed
        self.padded_vocab_size = config.padded_vocab_size(layout.tp_size)
        self.tp_group = layout.group("tp")
        self.sequence_parallel = layout.sequence_parallel
        self.context_parallel = layout.cp_size > 1
        stages = layout.config.stage_chunks(config.num_layers, layout.pp_rank)
        self.pre_process = any(stage.pre_process for stage in stages)
        self.post_process = any(stage.post_process for stage in stages)
        tied = config.share_embeddings_and_output_weights and output_layer
        self.has_output_layer = output_layer
        with_mtp = self.post_process and output_layer and mtp_depth(config) > 0

        self.embedding: Optional[VocabParallelEmbedding] = None
        if self.pre_process or (self.post_process and tied) or with_mtp:
            # The last stage of a pipeline keeps its own copy of a tied embedding, or of the one MTP embeds with
            # (drawn from the same seed and name, so equal); their gradients are summed over the first and last stage.
            self.embedding = VocabParallelEmbedding(
                self.padded_vocab_size,
                config.hidden_size,
                layout,
                init_std=config.init_method_std,
                vocab_size=config.vocab_size,
            )
            copied = tied or (output_layer and mtp_depth(config) > 0)  # the last stage holds a copy
            if copied and layout.pp_size > 1 and not (self.pre_process and self.post_process):
                # (a V placement holds the first and the last stage on one rank: one embedding serves both)
                # read with getattr by the engine (gradient sum) and gradient clipping (counted once)
                setattr(self.embedding.weight, "shared_embedding", True)
                setattr(self.embedding.weight, "pipeline_duplicate", not self.pre_process)
        self.position_embeddings: Optional[nn.Embedding] = None
        self.rotary: Optional[RotaryEmbedding] = None
        if config.position_embedding_type == "learned_absolute":
            if self.pre_process:
                assert config.max_position_embeddings is not None  # resolved by GPTConfig.__post_init__
                self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
                mark_parameter(self.position_embeddings.weight, ("normal", config.init_method_std))
        else:
            assert config.kv_channels is not None  # resolved by GPTConfig.__post_init__
            # MLA rotates only the decoupled positional part of each head
            rotated = config.qk_pos_emb_head_dim if config.multi_latent_attention else config.kv_channels
            assert rotated is not None  # checked by GPTConfig.__post_init__
            self.rotary = RotaryEmbedding(
                rotated, config.rotary_percent, config.rotary_base, scaling=config.rope_scaling()
            )
        self.moe_state: Optional[MoEStepState] = (
            MoEStepState() if config.num_moe_experts is not None or with_mtp else None
        )
        """Shared by the MoE layers and the MTP block: the engine's backward multiplier for their auxiliary losses,
        their metrics."""
        self.layers = nn.ModuleDict(
            {str(i): TransformerLayer(config, layout, i, self.moe_state) for stage in stages for i in stage.layers}
        )
        self.final_layernorm: Optional[Norm] = None
        self.output_layer: Optional[ColumnParallelLinear] = None
        if self.post_process:
            self.final_layernorm = Norm(
                config.normalization, config.hidden_size, config.layernorm_epsilon, layout.sequence_parallel
            )
            if output_layer:
                self.output_layer = ColumnParallelLinear(
                    config.hidden_size,
                    self.padded_vocab_size,
                    layout,
                    bias=False,
                    gather_output=False,
                    init_std=config.init_method_std,
                    skip_weight_param=tied,
                    unpadded_output_size=config.vocab_size,
                )
        self.mtp: Optional[MultiTokenPrediction] = None
        if with_mtp:
            assert self.moe_state is not None  # made for the MTP block just above
            state, last_is_moe = self.moe_state, moe_layer_pattern(config)[-1]
            self.mtp = MultiTokenPrediction(
                config, layout, state, lambda i: TransformerLayer(config, layout, i, state, moe=last_is_moe)
            )
        self.rng_tracker = model_parallel_rng_tracker(seed, layout.tp_rank, layout.pp_rank)
        self.chunks = [ModelChunk(self, index, stage) for index, stage in enumerate(stages)]
        # Per chunk: groups of its layers (global indices) for 'full' recompute (one plain group otherwise).
        self.layer_groups = [
            [
                ([stage.layers[i] for i in positions], checkpointed)
                for positions, checkpointed in full_recompute_groups(config, len(stage.layers))
            ]
            for stage in stages
        ]
        initialize_parameters(self, seed)

    def take_step_report(self) -> dict:
        """The metrics the MoE layers recorded since the last call (report entries; ``{}`` for a dense model)."""
        return self.moe_state.take() if self.moe_state is not None else {}

    @torch.no_grad()
    def finalize_moe_step(self) -> None:
        """Once per optimizer step, after the backward passes (Megatron's finalize_model_grads): expert biases move
        towards balance from the step's loads (summed over the stage's ranks), global-aux-loss counts restart."""
        if self.config.num_moe_experts is None:
            return
        from megatron_lite.core.models.moe.aux_loss import update_expert_bias
        from megatron_lite.core.models.moe.router import TopKRouter

        routers = [m for m in self.modules() if isinstance(m, TopKRouter)]
        with_bias = [r for r in routers if getattr(r, "expert_bias", None) is not None]
        if with_bias:
            update_expert_bias(with_bias, self.layout.group("tp_dp_cp"))
        for router in routers:
            router.reset_global_aux_counts()

    def layer(self, index: int) -> TransformerLayer:
        """The transformer layer of global index ``index`` (one of this rank's stages')."""
        # nn.ModuleDict is untyped; self.layers holds the TransformerLayers built in __init__
        return cast(TransformerLayer, self.layers[str(index)])

    def _output_weight(self) -> Optional[torch.Tensor]:
        """The weight the output layer multiplies by when it is tied to the embedding (None: its own)."""
        if not self.config.share_embeddings_and_output_weights:
            return None
        assert self.embedding is not None  # a last stage with a tied output layer keeps a copy of the embedding
        return self.embedding.weight

    def set_sequence_parallel(self, enabled: bool) -> None:
        """Switch sequence parallelism on or off (e.g. off for generation at arbitrary lengths).

        The weights are the same either way; only where activations are split changes.
        """
        if enabled and not self.layout.sequence_parallel:
            raise ValueError("this model was not built with sequence_parallel=True")
        for module in self.modules():
            if hasattr(module, "sequence_parallel"):
                setattr(module, "sequence_parallel", enabled)

    @contextlib.contextmanager
    def whole_sequence(self) -> Iterator[None]:
        """Run forwards on whole rows on every rank, context parallelism off (for logits over the full
        sequence and generation: every CP rank holds all the weights, so each can run alone)."""
        previous = self.context_parallel
        self.context_parallel = False
        try:
            yield
        finally:
            self.context_parallel = previous

    def attention_context(self, cu_seqlens: Optional[torch.Tensor]) -> Optional[AttentionContext]:
        """How this forward's tokens relate to the full rows (None: whole, unpacked rows)."""
        if not self.context_parallel:
            return AttentionContext(cu_seqlens=cu_seqlens) if cu_seqlens is not None else None
        layout = self.layout
        return AttentionContext(
            cu_seqlens=cu_seqlens,
            cp_size=layout.cp_size,
            cp_rank=layout.cp_rank,
            cp_group=layout.group("cp"),
            comm_type=layout.config.cp_comm_type,
            fused=layout.config.cp_fused_blocks,
        )

    def _embed(self, tokens: torch.Tensor, position_ids: Optional[torch.Tensor]) -> torch.Tensor:
        ids = tokens.t()  # [s, b]
        assert self.embedding is not None  # built on every first stage
        x = self.embedding(ids)
        if self.position_embeddings is not None:
            if position_ids is None:
                pos = self.position_embeddings(torch.arange(ids.shape[0], device=ids.device)).unsqueeze(1)
            else:
                pos = self.position_embeddings(position_ids).transpose(0, 1)  # [s, b, h]
            if self.sequence_parallel:
                pos = scatter_to_sequence_parallel_region(pos, self.tp_group)
            x = x + pos
        return hidden_dropout(x, self.config.hidden_dropout, self.training, self.sequence_parallel, self.rng_tracker)

    def forward(
        self,
        tokens: torch.Tensor,
        labels: Optional[torch.Tensor] = None,
        position_ids: Optional[torch.Tensor] = None,
        cu_seqlens: Optional[torch.Tensor] = None,
        hidden_states: Optional[torch.Tensor] = None,
        chunk: int = 0,
        loss_mask: Optional[torch.Tensor] = None,
        with_mtp: bool = True,
    ) -> torch.Tensor:
        """``tokens`` [b, s] -> logits [b, s, V_padded/tp] (padding at -inf), or per-token loss [b, s]
        given ``labels``.

        Packed rows pass ``position_ids`` [b, s] (restarting at 0 per document) and ``cu_seqlens``
        [b, k] (document start offsets, then the packed length, -1 padded): a token then attends only
        to earlier tokens of its own document. Under context parallelism ``tokens``, ``labels`` and
        ``position_ids`` are this CP rank's zigzag share of the rows
        (:func:`~megatron_lite.core.parallel.context_parallel.context_parallel_microbatch`) while
        ``cu_seqlens`` describes the whole rows. Under pipeline parallelism ``chunk`` picks the
        virtual stage to run and ``hidden_states`` are the previous stage's activations (every stage
        sees the tokens: they give the sequence length, the positions and the packing). ``loss_mask`` [b, s]
        masks the multi-token prediction loss like the main one (only a model with ``mtp_num_layers`` reads it);
        ``with_mtp=False`` leaves that loss out (objectives that score sequences with the main head: DPO).
        """
        stage = self.chunks[chunk].stage
        s = tokens.shape[1]
        if self.sequence_parallel and self.layout.tp_size > 1 and s % self.layout.tp_size:
            raise ValueError(
                f"sequence length {s} must be divisible by tensor_model_parallel_size "
                f"({self.layout.tp_size}) under sequence parallelism"
            )
        if self.context_parallel and position_ids is None:
            raise ValueError(
                "under context parallelism the model takes this rank's share of the rows with their "
                "position_ids: split microbatches with context_parallel_microbatch(...)"
            )
        positions = position_ids if position_ids is not None else torch.arange(s, device=tokens.device)
        rope = self.rotary(positions) if self.rotary is not None else None
        context = self.attention_context(cu_seqlens)
        if stage.pre_process:
            x = self._embed(tokens, position_ids)
        elif hidden_states is None:
            raise ValueError(
                f"chunk {chunk} (virtual stage {stage.virtual_stage}) starts inside the model: pass the "
                f"previous stage's activations as hidden_states"
            )
        else:
            x = hidden_states
        rng = self.rng_tracker
        for layer_ids, checkpointed in self.layer_groups[chunk]:
            group = [self.layer(i) for i in layer_ids]
            if checkpointed and recompute_active(self):
                x = checkpoint(_run_layers, group, x, rope, rng, context, rng_tracker=rng)
            else:
                x = _run_layers(group, x, rope, rng, context)
        if not stage.post_process:
            return x
        assert self.final_layernorm is not None  # built on every last stage
        x = self.final_layernorm(x)
        if self.output_layer is None:
            return x
        logits = self.output_layer(x, self._output_weight())  # [s, b, V/tp]
        if labels is None:
            return mask_vocab_padding(logits, self.vocab_start, self.config.vocab_size).transpose(0, 1)
        loss = vocab_parallel_cross_entropy(logits, labels.t(), self.tp_group, self.vocab_start, self.config.vocab_size)
        # contiguous: a [b, s] copy is cheap, and FSDP2 warns about (and cannot hook) view outputs
        loss = loss.t().contiguous()
        if self.mtp is not None and with_mtp:
            loss = self.mtp.attach_loss(self, loss, x, tokens, labels, loss_mask, position_ids, rope, context)
        return loss

    @torch.no_grad()
    def inference_forward(
        self,
        tokens: torch.Tensor,
        step,
        hidden_states: Optional[torch.Tensor] = None,
        chunk: int = 0,
        embeddings: Optional[torch.Tensor] = None,
    ) -> torch.Tensor:
        """One generation step of chunk ``chunk``: ``tokens`` [b, s] are the step's new tokens (the prompt
        in the prefill, one per row in a decode step) and ``step`` an
        :class:`~megatron_lite.core.inference.kv_cache.InferenceStep` (positions, mask, KV cache).

        Returns the activations [s, b, h] for the next stage, or on the last stage this TP rank's logits
        of the last position only [b, V_padded/tp] (the only ones generation needs). Run with sequence
        and context parallelism off (``megatron_lite.core.inference.generate`` sees to it). ``embeddings``
        [s, b, h] are the tokens' word embeddings when the caller has them already (no lookup, and no
        all-reduce of a vocabulary-parallel one)."""
        stage = self.chunks[chunk].stage
        rope = None
        if self.rotary is not None:  # once per step; [s, b, 1, 1, dim] broadcasts over query groups and heads
            rope = rotary_tables(*(t.unsqueeze(3) for t in self.rotary(step.positions)))
        if not stage.pre_process:
            if hidden_states is None:
                raise ValueError(
                    f"chunk {chunk} (virtual stage {stage.virtual_stage}) starts inside the model: pass "
                    f"the previous stage's activations as hidden_states"
                )
            x = hidden_states
        elif embeddings is None:
            x = self._embed(tokens, step.positions)
        else:
            x = embeddings
            if self.position_embeddings is not None:
                x = x + self.position_embeddings(step.positions).transpose(0, 1)
        for i in stage.layers:
            x = self.layer(i).inference_forward(x, rope, step.kv(i), step)
        if not stage.post_process:
            return x
        if self.output_layer is None:
            raise ValueError("generation needs the vocabulary projection: this model was built with output_layer=False")
        assert self.final_layernorm is not None  # built on every last stage
        return self.output_layer(self.final_layernorm(x[-1:]), self._output_weight())[0]

    @property
    def vocab_start(self) -> int:
        """First vocabulary row of this TP rank's slice of the output layer."""
        return self.layout.tp_rank * (self.padded_vocab_size // self.layout.tp_size)

    @torch.no_grad()
    def full_logits(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits over the real vocabulary ``[b, s, vocab_size]``, gathered across TP (one pipeline
        stage only: under pipeline parallelism the engine's forward-only pipeline gives them)."""
        if len(self.chunks) != 1 or not (self.pre_process and self.post_process):
            raise RuntimeError(
                "full_logits runs the whole model on one rank; under pipeline parallelism use "
                "GPTModule.full_logits (the engine's forward-only pipeline)"
            )
        # self(...), not self.forward(...): module hooks must run (FSDP2 all-gathers its shards in them)
        with self.whole_sequence():
            return gather_real_vocab(self(tokens), self.tp_group, self.config.vocab_size)

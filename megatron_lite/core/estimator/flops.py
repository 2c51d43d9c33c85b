"""Model FLOPs of a GPT, dense or Mixture-of-Experts (DESIGN.md section 3, "FLOPs per step").

Conventions (those of Megatron-LM and of MFU):

* Only matrix multiplications are counted, 2 FLOPs per multiply-add; norms, activations, softmax,
  rotary embedding and the optimizer are left out (they are a fraction of a percent at scale).
* Causal attention is counted at half: ``QK^T`` and ``attention x V`` cost ``2 s d`` per query head
  and token each over the full square, and a causal mask needs half of it. Kernels that skip the
  masked blocks (flash attention) do about that much work; a dense kernel does twice as much.
* The logits use the padded vocabulary (Megatron's ``padded_vocab_size``): that is the matrix the
  hardware multiplies. The input embedding is a lookup and costs nothing.
* Training = forward + backward = 3 x forward (the backward computes the gradients of both the
  inputs and the weights of every matmul), i.e. ``6 x parameters`` per token plus attention.
* Mixture of Experts: a token's work is that of its *active* parameters (Megatron's
  ``num_floating_point_operations``): in an MoE layer its ``moe_router_topk`` experts and the shared expert
  (with its gate), plus the router's ``H -> E`` GEMM (which Megatron leaves out), whatever the expert layout;
  tokens dropped by a capacity factor are counted as routed. MFU thus counts active parameters.
* Per objective: a sample costs what its objective says
  (:class:`~megatron_lite.core.estimator.objective_cost.ObjectiveCost`): a DPO pair is two sequences plus
  the reference model's forward over both, a GRPO prompt ``group_size`` sequences trained
  ``updates_per_batch`` times after the old-log-prob (and reference) forwards. GRPO's rollout generation is
  not counted (its length varies per rollout), so GRPO's MFU is a lower bound.
* LoRA: the frozen base still runs its forward and the backward's input gradients, but no weight-gradient GEMM
  (``4/6`` of its weight matmuls' training FLOPs; attention's backward is unchanged), and the adapters train in
  full: ``6 x`` their parameters per token (``A [dim, in]`` and ``B [out, dim]`` of every adapted layer). That
  autograd also skips the input gradients below the first adapter (nothing there trains) is not subtracted.
* Activation recomputation does **not** change these numbers: model FLOPs count the work the model
  needs, not the work the hardware repeats, which is what makes MFU comparable across recompute
  settings (Megatron's "hardware FLOPs" would add one more forward of the recomputed part).
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Optional

from megatron_lite.core.estimator.objective_cost import ObjectiveCost
from megatron_lite.core.estimator.parameters import parameter_shapes
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe_config import moe_layer_pattern
from megatron_lite.core.models.moe_sizes import mlp_weights, moe_router_parameters
from megatron_lite.core.models.mtp_config import mtp_depth
from megatron_lite.core.peft.config import LoRAConfig


@dataclass(frozen=True)
class FlopsBreakdown:
    """Forward FLOPs per token of the whole model, by part (matmuls only, 2 FLOPs per multiply-add)."""

    qkv: float
    """Query/key/value projection of every layer (with GQA the keys and values are narrower)."""
    attention: float
    """``QK^T`` and ``attention x V`` of every layer; causal attention counted at half unless asked otherwise."""
    projection: float
    """Attention output projection of every layer."""
    mlp: float
    """MLP of every layer (the fused gate/up projection of SwiGLU is 3/2 of a plain ``h -> ffn -> h`` MLP); in an
    MoE layer a token's top-k experts, the shared expert and its gate."""
    logits: float
    """Output layer over the padded vocabulary (once more per multi-token prediction depth)."""
    router: float = 0.0
    """Router GEMM (``H -> num_moe_experts``) of every MoE layer (0 for a dense model)."""
    mtp_projection: float = 0.0
    """Multi-token prediction: each depth's ``2H -> H`` projection of [embedding; hidden] (its transformer layer is
    counted with the model's layers, of the last layer's kind)."""

    @property
    def total(self) -> float:
        """Sum of all parts."""
        return sum(getattr(self, f.name) for f in fields(self))

    @property
    def matmul_with_weights(self) -> float:
        """Every part that multiplies by a weight matrix (all but ``attention``): ``2 x`` those parameters."""
        return self.total - self.attention


def forward_flops_breakdown(
    config: GPTConfig, seq_length: Optional[int] = None, *, tensor_model_parallel_size: int = 1, causal: bool = True
) -> FlopsBreakdown:
    """Forward FLOPs per token of ``config`` at ``seq_length`` (default: the config's).

    ``tensor_model_parallel_size`` only decides the vocabulary padding (Megatron pads to a multiple
    of ``make_vocab_size_divisible_by x tp``). ``causal=False`` counts the full attention square, as
    a dense attention kernel (or ``torch.utils.flop_counter``) does.
    """
    s = config.seq_length if seq_length is None else seq_length
    depth = mtp_depth(config)
    h, layers, d = config.hidden_size, config.num_layers + depth, config.kv_channels  # an MTP depth runs a layer
    # resolved by GPTConfig.__post_init__
    assert d is not None and config.num_query_groups is not None and config.ffn_hidden_size is not None
    q_width = config.num_attention_heads * d
    kv_width = 2 * config.num_query_groups * d
    vocab = config.padded_vocab_size(tensor_model_parallel_size)
    attention_square = 2 * (2 * s * q_width)  # QK^T and AV over all s keys, per query token
    qkv_weights, out_width = h * (q_width + kv_width), q_width
    if config.multi_latent_attention:  # latent projections; values of their own width
        assert config.v_head_dim is not None  # resolved with MLA
        out_width = config.num_attention_heads * config.v_head_dim
        qkv_weights = config.mla_parameters(norms=False) - out_width * h
        attention_square = 2 * s * (q_width + out_width)
    pattern = moe_layer_pattern(config)
    moe = sum(pattern) + (depth if pattern[-1] else 0)  # the MTP layers are of the last layer's kind
    mlp = (layers - moe) * mlp_weights(config, config.ffn_hidden_size)
    if moe:  # per token: its top-k experts, the shared expert and the shared expert's [1, H] gate
        assert config.moe_ffn_hidden_size is not None  # resolved for MoE models by the config checks
        shared = config.moe_shared_expert_intermediate_size
        mlp += moe * (
            config.moe_router_topk * mlp_weights(config, config.moe_ffn_hidden_size)
            + (mlp_weights(config, shared) if shared is not None else 0)
            + (h if config.moe_shared_expert_gate else 0)
        )
    return FlopsBreakdown(
        qkv=layers * 2.0 * qkv_weights,
        attention=layers * float(attention_square) / (2 if causal else 1),
        projection=layers * 2.0 * out_width * h,
        mlp=2.0 * mlp,
        logits=(1 + depth) * 2.0 * h * vocab,
        router=2.0 * moe * moe_router_parameters(config),
        mtp_projection=depth * 2.0 * (2 * h) * h,
    )


def forward_flops_per_token(
    config: GPTConfig, seq_length: Optional[int] = None, *, tensor_model_parallel_size: int = 1
) -> float:
    """Forward FLOPs per token (causal attention at half, padded vocabulary, matmuls only)."""
    return forward_flops_breakdown(config, seq_length, tensor_model_parallel_size=tensor_model_parallel_size).total


def training_flops_per_step(
    config: GPTConfig,
    global_batch_size: int,
    seq_length: Optional[int] = None,
    *,
    tensor_model_parallel_size: int = 1,
    cost: ObjectiveCost = ObjectiveCost(),
    lora: Optional[LoRAConfig] = None,
) -> float:
    """Model FLOPs of one training step over ``global_batch_size`` samples, summed over every rank (divide
    by the number of devices for per-device FLOPs): each sample's ``cost.forwards_per_sample`` forwards of a
    ``seq_length`` sequence (pre-training: ``3 x forward``). Recompute is not counted. ``lora``: a LoRA fine-tune
    of the frozen model (no weight gradients for the base; the adapters' FLOPs added)."""
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size must be a positive integer, got {global_batch_size}")
    s = config.seq_length if seq_length is None else seq_length
    if lora is None:
        per_token = forward_flops_per_token(config, s, tensor_model_parallel_size=tensor_model_parallel_size)
        return cost.forwards_per_sample * per_token * global_batch_size * s
    base = forward_flops_breakdown(config, s, tensor_model_parallel_size=tensor_model_parallel_size)
    adapters = 2.0 * lora_parameters(config, lora, active=True)  # forward, per token
    forward = base.total + adapters
    # backward: the attention's and the base's input gradients (2x and 1x their forward), the adapters' both
    training = forward + 2 * base.attention + base.matmul_with_weights + 2 * adapters
    per_sequence_token = cost.training_passes * training + cost.forward_only_passes * forward
    return cost.sequences_per_sample * per_sequence_token * global_batch_size * s


def lora_parameters(config: GPTConfig, lora: LoRAConfig, active: bool = False) -> int:
    """Parameters of the adapters ``lora`` adds to a model of ``config`` (``dim x (in + out)`` per adapted layer);
    ``active``: those one token runs through (of an MoE layer's expert adapters, its ``moe_router_topk`` experts')."""
    total = 0
    for p in parameter_shapes(config, lora=lora):
        if p.trainable:
            experts = config.num_moe_experts if p.is_expert and active else None
            total += p.numel * config.moe_router_topk // experts if experts else p.numel
    return total


def megatron_formula_flops(
    batch_size: int, seq_length: int, num_layers: int, hidden_size: int, vocab_size: int
) -> float:
    """``72 B s L h^2 (1 + s/(12h) + V/(12 L h))``: training FLOPs of a GPT with ffn = 4h, no GQA, a
    plain (non-gated) MLP and causal attention at half (Narayanan et al. 2021 without recompute)."""
    b, s, layers, h, v = batch_size, seq_length, num_layers, hidden_size, vocab_size
    return 72.0 * b * s * layers * h * h * (1.0 + s / (12.0 * h) + v / (12.0 * layers * h))


def attention_flops_per_cp_rank(
    config: GPTConfig, seq_length: Optional[int] = None, cp_size: int = 1, split: str = "zigzag"
) -> list:
    """Forward ``QK^T`` and ``attention x V`` FLOPs of one sequence on each of ``cp_size`` context-parallel
    ranks, counted from the chunk geometry (causal: a chunk attends to earlier chunks in full and to itself at
    half, the convention of :func:`forward_flops_breakdown`, so the ranks' sum is the model's attention FLOPs).

    ``split="zigzag"`` cuts the sequence into ``2 x cp_size`` chunks, rank r holding chunks r and 2C-1-r (what
    context parallelism does: every rank gets the same work); ``"contiguous"`` cuts it into ``cp_size`` chunks,
    rank r holding chunk r (the naive split: rank r's work grows as 2r + 1, ``2C - 1`` times more on the last
    rank than on the first)."""
    s = config.seq_length if seq_length is None else seq_length
    if split not in ("zigzag", "contiguous"):
        raise ValueError(f"split must be 'zigzag' or 'contiguous', got {split!r}")
    pieces = 2 * cp_size if split == "zigzag" else cp_size
    if s % pieces:
        raise ValueError(
            f"seq_length ({s}) must be divisible by the {pieces} chunks of a {split} split over {cp_size} ranks"
        )
    chunk = s // pieces
    assert config.kv_channels is not None  # resolved by GPTConfig.__post_init__
    per_pair = config.num_layers * 2 * (2 * chunk * chunk * config.num_attention_heads * config.kv_channels)

    def work(c: int) -> float:  # chunk c against chunks 0..c-1 in full, itself at half
        return per_pair * (c + 0.5)

    if split == "contiguous":
        return [work(r) for r in range(cp_size)]
    return [work(r) + work(2 * cp_size - 1 - r) for r in range(cp_size)]

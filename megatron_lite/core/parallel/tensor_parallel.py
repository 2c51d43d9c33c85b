"""Tensor-parallel layers (Megatron's ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding).

Each layer holds its local shard as a plain parameter and records how that shard sits in the global
tensor (:class:`TPShard`), so that initialisation is independent of the layout (the full tensor is
drawn from the seed, then sharded) and checkpoints can be written as global tensors.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Optional, TypeVar

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_lite.core.parallel.weight_grad import WeightGradStore, deferrable_linear


@dataclass(frozen=True)
class TPShard:
    """Where a tensor-parallel shard sits in its global tensor."""

    dim: int
    """Dimension split across the TP group."""
    stride: int
    """Number of equal blocks along ``dim`` that are each split separately (2 for fused gate/up)."""
    global_shape: tuple
    """Shape of the full tensor."""
    rank: int
    """This shard's TP rank."""
    size: int
    """TP group size."""
    unpadded_size: Optional[int] = None
    """Length of ``dim`` without vocabulary padding (the rows from here on are padding: zero, outside every
    softmax, never checkpointed); None when the tensor is not padded."""
    group: str = "tp"
    """The layout's group the tensor is split over: 'tp', or 'etp' for an expert's weights."""

    def __post_init__(self) -> None:
        if self.unpadded_size is not None:
            if self.stride != 1:
                raise ValueError(f"a padded tensor cannot be split in {self.stride} blocks (stride must be 1)")
            if not 0 < self.unpadded_size <= self.global_shape[self.dim]:
                raise ValueError(f"unpadded_size {self.unpadded_size} must lie in (0, {self.global_shape[self.dim]}]")

    @property
    def real_shape(self) -> tuple:
        """The global shape without vocabulary padding: what checkpoints and full state dicts hold."""
        if self.unpadded_size is None:
            return tuple(self.global_shape)
        shape = list(self.global_shape)
        shape[self.dim] = self.unpadded_size
        return tuple(shape)

    @property
    def local_start(self) -> int:
        """Offset along ``dim`` of this rank's shard in the global tensor (stride 1)."""
        return self.rank * (self.global_shape[self.dim] // self.size)

    @property
    def local_real_size(self) -> int:
        """How many of this rank's rows along ``dim`` are real (not padding): all of them on ranks before the
        padding, fewer on the rank where it starts, none on ranks that hold only padding."""
        local = self.global_shape[self.dim] // self.size
        if self.unpadded_size is None:
            return local
        return max(0, min(local, self.unpadded_size - self.local_start))

    def pad(self, real: torch.Tensor) -> torch.Tensor:
        """``real`` (shaped :attr:`real_shape`) with zero padding rows appended up to ``global_shape``."""
        missing = self.global_shape[self.dim] - real.shape[self.dim]
        if self.unpadded_size is None or missing == 0:
            return real
        zeros = real.new_zeros(*real.shape[: self.dim], missing, *real.shape[self.dim + 1 :])
        return torch.cat([real, zeros], dim=self.dim)

    def unpad(self, full: torch.Tensor) -> torch.Tensor:
        """The real rows of a global tensor (a view; ``full`` itself when nothing is padded)."""
        if self.unpadded_size is None or full.shape[self.dim] == self.unpadded_size:
            return full
        return full.narrow(self.dim, 0, self.unpadded_size)

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of ``full``: the global tensor, or its real rows only (padded with zeros first)."""
        if self.unpadded_size is not None and full.shape[self.dim] == self.unpadded_size:
            full = self.pad(full)
        if self.size == 1:
            return full
        blocks = full.chunk(self.stride, dim=self.dim)
        return torch.cat([b.chunk(self.size, dim=self.dim)[self.rank] for b in blocks], dim=self.dim)

    def blocked_view(self, local: torch.Tensor) -> tuple[torch.Tensor, tuple, int]:
        """``local`` reshaped so that the shard is one contiguous slice of a global tensor.

        Returns (view, global shape of the view, dim along which the view is sharded): with stride
        s the global tensor is seen as ``[..., s, n/s, ...]`` and the shard as ``[..., s, n/(s*tp), ...]``.
        """
        if self.stride == 1:
            return local, tuple(self.global_shape), self.dim
        d = self.dim
        gshape = list(self.global_shape)
        view = local.reshape(*local.shape[:d], self.stride, local.shape[d] // self.stride, *local.shape[d + 1 :])
        global_view = (*gshape[:d], self.stride, gshape[d] // self.stride, *gshape[d + 1 :])
        return view, global_view, d + 1


@dataclass(frozen=True)
class ExpertShard:
    """Where the local experts of an MoE layer's weight sit among all its experts: dimension 0 of the global
    ``[num_experts, ...]`` tensor, split evenly over the expert-parallel group ('ep')."""

    num_experts: int
    """Experts of the layer (the global tensor's dimension 0)."""
    rank: int
    """This rank's index in the expert-parallel group."""
    size: int
    """Expert-parallel group size."""

    @property
    def num_local_experts(self) -> int:
        """Experts this rank holds."""
        return self.num_experts // self.size

    @property
    def local_start(self) -> int:
        """Global index of this rank's first expert."""
        return self.rank * self.num_local_experts

    def shard(self, full: torch.Tensor) -> torch.Tensor:
        """This rank's experts of the global tensor."""
        return full.narrow(0, self.local_start, self.num_local_experts)

    def global_shape(self, local_shape: tuple) -> tuple:
        """The shape of the tensor of all experts whose local part (this rank's experts) is shaped ``local_shape``."""
        return (self.num_experts, *local_shape[1:])


_Param = TypeVar("_Param", bound=torch.Tensor)


def mark_parameter(
    param: _Param,
    init: tuple,
    shard: Optional[TPShard] = None,
    sequence_parallel_grad: bool = False,
    tp_partial_grad: bool = False,
    expert_shard: Optional[ExpertShard] = None,
) -> _Param:
    """Attach the metadata every parameter of our models carries.

    ``init`` is ("normal", std), ("zeros",) or ("ones",); ``shard`` is None for replicated
    parameters; ``sequence_parallel_grad`` marks replicated parameters whose gradient is partial
    per TP rank under sequence parallelism (norm weights, row-parallel biases); ``tp_partial_grad``
    marks replicated parameters whose gradient is partial per TP rank with or without it (weights
    every attention head shares, as qk_layernorm's: each TP rank computes only its own heads).
    ``expert_shard`` marks the weights of an MoE layer's experts (``[local experts, ...]``): their gradients are
    reduced over the expert-data-parallel group, not DP x CP, and their ``shard`` (if any) is over 'etp'.
    """
    # Plain attributes on the tensor (Megatron's convention: they follow the parameter wherever it goes);
    # readers take them with getattr(param, name, default).
    setattr(param, "init_spec", init)
    setattr(param, "tp_shard", shard)
    setattr(param, "sequence_parallel_grad", sequence_parallel_grad)
    setattr(param, "tp_partial_grad", tp_partial_grad)
    setattr(param, "expert_shard", expert_shard)
    return param


def is_expert_parameter(param: torch.Tensor) -> bool:
    """Whether ``param`` belongs to an MoE layer's experts (gradients reduced over the expert-DP group)."""
    return getattr(param, "expert_shard", None) is not None


def is_tensor_parallel(param: torch.Tensor) -> bool:
    """Whether ``param`` is a genuine TP shard (not a replica)."""
    shard = getattr(param, "tp_shard", None)
    return shard is not None and shard.size > 1


def full_shape(tensor: torch.Tensor, padded: bool = False) -> tuple:
    """The shape of the whole tensor that ``tensor`` (a parameter or buffer marked by :func:`mark_parameter`) is this
    rank's piece of: over TP (or ETP) and over all experts; without vocabulary padding unless ``padded``."""
    shard: Optional[TPShard] = getattr(tensor, "tp_shard", None)
    experts: Optional[ExpertShard] = getattr(tensor, "expert_shard", None)
    if shard is None:
        shape = tuple(tensor.shape)
    else:
        shape = tuple(shard.global_shape) if padded else shard.real_shape
    return experts.global_shape(shape) if experts is not None else shape


def local_shard(tensor: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """This rank's piece of ``full`` (shaped :func:`full_shape` of ``tensor``): its experts, then its TP/ETP slice."""
    experts: Optional[ExpertShard] = getattr(tensor, "expert_shard", None)
    shard: Optional[TPShard] = getattr(tensor, "tp_shard", None)
    if experts is not None:
        full = experts.shard(full)
    return shard.shard(full) if shard is not None else full


def _seed_for(seed: int, name: str) -> int:
    # A stable per-parameter seed: the same name gets the same weights at any layout.
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


@torch.no_grad()
def initialize_parameters(module: nn.Module, seed: int) -> None:
    """Draw every parameter's full tensor from (seed, name), then keep this rank's shard. An MoE layer's expert
    weight ``[num_experts, ...]`` is drawn expert by expert, expert ``e`` from (seed, name, e): the whole tensor is
    the same at any EP and ETP size, and a rank draws only its own experts (all experts of a large MoE layer can
    be tens of GB)."""
    for name, param in module.named_parameters():
        initialize_parameter(name, param, seed)


@torch.no_grad()
def initialize_parameter(name: str, param: torch.Tensor, seed: int) -> None:
    """Draw one parameter (marked by :func:`mark_parameter`) as :func:`initialize_parameters` does, from (seed,
    ``name``): what a module added to a built model (an adapter) initialises its own parameters with."""
    spec = getattr(param, "init_spec", None)
    if spec is None:
        raise ValueError(f"parameter {name} has no init_spec; build it with mark_parameter()")
    shard: Optional[TPShard] = getattr(param, "tp_shard", None)
    if spec[0] == "zeros":
        param.zero_()
        return
    if spec[0] == "ones":
        if shard is not None and shard.unpadded_size is not None:
            raise ValueError(f"parameter {name}: a vocabulary-padded tensor cannot be initialised to ones")
        param.fill_(1.0)
        return
    # Only the real rows of a vocabulary-padded tensor are drawn, exactly as an unpadded tensor would be
    # (the same weights whatever the padding, hence whatever the TP size); the padding rows are zero.
    shape = full_shape(param)
    experts: Optional[ExpertShard] = getattr(param, "expert_shard", None)
    if experts is None:
        full = _normal(shape, spec[1], _seed_for(seed, name))
    else:  # this rank's experts, each whole over ETP
        local_experts = range(experts.local_start, experts.local_start + experts.num_local_experts)
        full = torch.stack([_normal(shape[1:], spec[1], _seed_for(seed, f"{name}#expert{e}")) for e in local_experts])
    local = shard.shard(full) if shard is not None else full
    param.copy_(local.to(dtype=param.dtype, device=param.device))


def _normal(shape: tuple, std: float, seed: int) -> torch.Tensor:
    # Drawn on the CPU with a CPU generator even when Lightning builds the model under a CUDA
    # default device: the same numbers on every device and layout.
    generator = torch.Generator().manual_seed(seed)
    return torch.empty(shape, dtype=torch.float32, device="cpu").normal_(0.0, std, generator=generator)


def _divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what} ({n}) must be divisible by tensor_model_parallel_size ({d})")
    return n // d


class _LocalGemm(nn.Module):
    """The rank-local matrix product of a tensor-parallel linear, as a method of its own: the one place that
    sees this rank's input and weight after the collectives, where quantization wraps the layer
    (``megatron_lite.post_training.modelopt_registry``).

    ``adapter``: a module whose output is added to the layer's (LoRA, ``megatron_lite.core.peft``), called with the
    layer's own input (sharded as the layer receives it) and whether the layer runs sequence-parallel now; None (the
    default) adds nothing. It sits beside the base weight, so the base's parameter names stay as they are."""

    adapter: Optional[nn.Module]
    weight_grad_store: Optional[WeightGradStore] = None
    """Set by a zero-bubble pipeline schedule (:func:`defer_weight_grads`): the backward passes it captures leave
    this layer's weight gradient to its weight pass."""

    def __init__(self) -> None:
        super().__init__()
        self.register_module("adapter", None)

    def adapter_output(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        """The adapter's contribution for the layer's input ``x``, or None (no adapter, or one switched off)."""
        adapter = self.adapter
        if adapter is None or not getattr(adapter, "enabled", True):
            return None
        return adapter(x, self.sequence_parallel)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        store = self.weight_grad_store
        # Only the layer's own weight: a weight passed in (the output layer's tied embedding) also gets gradients
        # elsewhere in the same backward, which a deferred share would split over two accumulations.
        if store is not None and weight is self.weight and weight.requires_grad:
            return deferrable_linear(x, weight, bias, store)
        return F.linear(x, weight, bias)


class ColumnParallelLinear(_LocalGemm):
    """``Y = X A^T + b`` with ``A`` split along its output dimension over the TP group.

    Under sequence parallelism the input arrives sharded along the sequence and is all-gathered
    first; otherwise it is replicated and its gradient all-reduced.
    """

    def __init__(
        self,
        input_size: int,
        output_size: int,
        layout: ParallelLayout,
        *,
        bias: bool = True,
        gather_output: bool = False,
        init_std: float = 0.02,
        stride: int = 1,
        skip_weight_param: bool = False,
        params_dtype: torch.dtype = torch.float32,
        unpadded_output_size: Optional[int] = None,
    ):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.gather_output = gather_output
        self.tp_group = layout.group("tp")
        self.sequence_parallel = layout.sequence_parallel
        tp = layout.tp_size
        self.output_size_per_partition = _divide(output_size, tp, "output size")
        if stride > 1 and output_size % (stride * tp) != 0:
            raise ValueError(f"output size {output_size} must be divisible by {stride} x tensor_model_parallel_size")
        # unpadded_output_size: the real vocabulary of an output layer padded to output_size (the weight's
        # later rows are padding).
        wshard = TPShard(0, stride, (output_size, input_size), layout.tp_rank, tp, unpadded_output_size)
        if bias and unpadded_output_size is not None:
            raise ValueError("a vocabulary-padded ColumnParallelLinear has no bias (the padding would need one too)")
        if skip_weight_param:
            self.register_parameter("weight", None)
        else:
            self.weight = mark_parameter(
                nn.Parameter(torch.empty(self.output_size_per_partition, input_size, dtype=params_dtype)),
                ("normal", init_std),
                wshard,
            )
        if bias:
            self.bias = mark_parameter(
                nn.Parameter(torch.empty(self.output_size_per_partition, dtype=params_dtype)),
                ("zeros",),
                TPShard(0, stride, (output_size,), layout.tp_rank, tp),
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor, weight: Optional[torch.Tensor] = None) -> torch.Tensor:
        weight = self.weight if weight is None else weight
        delta = self.adapter_output(x)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.tp_group, grad_is_partial=True)
        else:
            x = copy_to_tensor_parallel_region(x, self.tp_group)
        y = self.linear(x, weight, self.bias)
        if delta is not None:
            y = y + delta
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.tp_group)
        return y


class RowParallelLinear(_LocalGemm):
    """``Y = X A^T + b`` with ``A`` split along its input dimension; partial outputs are summed
    (all-reduce, or reduce-scatter along the sequence under sequence parallelism)."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        layout: ParallelLayout,
        *,
        bias: bool = True,
        init_std: float = 0.02,
        params_dtype: torch.dtype = torch.float32,
    ):
        super().__init__()
        self.input_size, self.output_size = input_size, output_size
        self.tp_group = layout.group("tp")
        self.sequence_parallel = layout.sequence_parallel
        tp = layout.tp_size
        self.input_size_per_partition = _divide(input_size, tp, "input size")
        self.weight = mark_parameter(
            nn.Parameter(torch.empty(output_size, self.input_size_per_partition, dtype=params_dtype)),
            ("normal", init_std),
            TPShard(1, 1, (output_size, input_size), layout.tp_rank, tp),
        )
        if bias:
            self.bias = mark_parameter(
                nn.Parameter(torch.empty(output_size, dtype=params_dtype)),
                ("zeros",),
                None,
                sequence_parallel_grad=self.sequence_parallel,
            )
        else:
            self.register_parameter("bias", None)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = reduce_from_tensor_parallel_region(y, self.tp_group)
        delta = self.adapter_output(x)
        if delta is not None:
            y = y + delta
        return y + self.bias if self.bias is not None else y


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocabulary; each rank looks up its range and the partial
    results are summed (or reduce-scattered along the sequence under sequence parallelism).

    ``num_embeddings`` is the padded vocabulary and ``vocab_size`` the real one: the padding rows are zero
    and never looked up (token ids are below ``vocab_size``)."""

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        layout: ParallelLayout,
        *,
        init_std: float = 0.02,
        params_dtype: torch.dtype = torch.float32,
        vocab_size: Optional[int] = None,
    ):
        super().__init__()
        tp = layout.tp_size
        self.tp_group = layout.group("tp")
        self.sequence_parallel = layout.sequence_parallel
        self.num_embeddings = num_embeddings
        self.num_embeddings_per_partition = _divide(num_embeddings, tp, "padded vocabulary size")
        self.vocab_start = layout.tp_rank * self.num_embeddings_per_partition
        self.vocab_end = self.vocab_start + self.num_embeddings_per_partition
        self.weight = mark_parameter(
            nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=params_dtype)),
            ("normal", init_std),
            TPShard(0, 1, (num_embeddings, embedding_dim), layout.tp_rank, tp, vocab_size),
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids`` [s, b] -> embeddings [s, b, h] (or [s/tp, b, h] under sequence parallelism)."""
        if self.tp_group is None:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local_ids = (ids - self.vocab_start).masked_fill(outside, 0)
        out = F.embedding(local_ids, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.tp_group)
        return reduce_from_tensor_parallel_region(out, self.tp_group)


def pad_vocab_size(vocab_size: int, divisible_by: int, tp_size: int) -> int:
    """Megatron's padding: round up to a multiple of ``divisible_by x tp_size``."""
    multiple = divisible_by * tp_size
    return int(math.ceil(vocab_size / multiple) * multiple)


def gather_full(local: torch.Tensor, shard: Optional[TPShard], group) -> torch.Tensor:
    """The full tensor from every TP rank's ``local`` piece (the inverse of :meth:`TPShard.shard`), without
    vocabulary padding (its real rows only, :attr:`TPShard.real_shape`): the same at any TP size.

    Collective over ``group``: every TP rank must call it.
    """
    if shard is None:
        return local
    if shard.size == 1 or group is None:
        return shard.unpad(local)
    import torch.distributed as dist

    pieces = [torch.empty_like(local) for _ in range(shard.size)]
    dist.all_gather(pieces, local.contiguous(), group=group)
    blocks_per_rank = [p.chunk(shard.stride, dim=shard.dim) for p in pieces]
    blocks = [
        torch.cat([rank_blocks[b] for rank_blocks in blocks_per_rank], dim=shard.dim) for b in range(shard.stride)
    ]
    return shard.unpad(torch.cat(blocks, dim=shard.dim))


def gather_full_tensor(local: torch.Tensor, tensor: torch.Tensor, layout: ParallelLayout) -> torch.Tensor:
    """The whole tensor (:func:`full_shape`) from every rank's ``local`` piece of ``tensor``: the inverse of
    :func:`local_shard`. Collective over the tensor's TP (or ETP) group and, for an expert's weight, over EP."""
    shard: Optional[TPShard] = getattr(tensor, "tp_shard", None)
    group = layout.group(shard.group) if shard is not None and shard.size > 1 else None
    full = gather_full(local, shard, group)
    experts: Optional[ExpertShard] = getattr(tensor, "expert_shard", None)
    if experts is None or experts.size == 1:
        return full
    import torch.distributed as dist

    pieces = [torch.empty_like(full) for _ in range(experts.size)]
    dist.all_gather(pieces, full.contiguous(), group=layout.group("ep"))
    return torch.cat(pieces, dim=0)


def defer_weight_grads(model: nn.Module, store: Optional[WeightGradStore]) -> int:
    """Give every tensor-parallel linear layer of ``model`` the weight-gradient ``store`` of a zero-bubble schedule
    (None takes it away); returns how many layers hold it."""
    layers = [module for module in model.modules() if isinstance(module, _LocalGemm)]
    for layer in layers:
        layer.weight_grad_store = store
    return len(layers)

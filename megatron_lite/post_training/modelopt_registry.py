"""Our tensor-parallel linears in nvidia-modelopt's quant-module registry.

ModelOpt quantizes only module classes it knows (``QuantModuleRegistry``) and silently skips the others;
its Megatron plugin registers Megatron-core's ``ColumnParallelLinear``/``RowParallelLinear`` (it loads only
where ``megatron.core`` imports, as in the dev environment, where megatron-core is a test reference; it never
touches our classes). Here our two layers get their quantized counterparts: an
input, a weight and a (disabled) output quantizer around the rank-local GEMM (``_LocalGemm.linear``, which
sees the input after the sequence-parallel all-gather and the weight as this rank holds it), and a
``ParallelState`` naming the data-parallel (dp x cp) and tensor-parallel groups. With it ModelOpt's own
calibration synchronises amax the Megatron way: per-tensor amax over DP (ranks calibrate on different
data) and over TP where the tensor is split (a row-parallel layer's input, the per-output-channel weight
amax of a row-parallel layer, per-tensor weight amax), so a quantized TP2 model equals a quantized TP1 one.

Registry keys (stable: quantizer names in configs and exports depend on them):
``megatron_lite_ColumnParallelLinear`` and ``megatron_lite_RowParallelLinear``; the quantizers are
``<layer>.input_quantizer``, ``<layer>.weight_quantizer`` and ``<layer>.output_quantizer``, layers named as in
GPTModel (``layers.<i>.self_attention.linear_qkv``, ``.linear_proj``, ``layers.<i>.mlp.linear_fc1``,
``.linear_fc2``, ``output_layer`` -- which ModelOpt's presets leave unquantized, as Megatron's).

Imported only by the functions that quantize: ``import megatron_lite`` never imports modelopt.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from megatron_lite.core.models.attention import SelfAttention
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear, TPShard
from megatron_lite.utils.optional import require

COLUMN_KEY = "megatron_lite_ColumnParallelLinear"
ROW_KEY = "megatron_lite_RowParallelLinear"

_mtq = require("modelopt.torch.quantization", "megatron-lite quantization")
from modelopt.torch.quantization.nn import QuantModule, QuantModuleRegistry, TensorQuantizer  # noqa: E402
from modelopt.torch.quantization.tensor_quant import (  # noqa: E402
    QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW,
    QUANT_DESC_8BIT_PER_TENSOR,
)
from modelopt.torch.utils.distributed import ParallelState  # noqa: E402

NO_GROUP = -1
"""ModelOpt's marker for "no such parallel group" (its None means the whole world)."""


def parallel_state(layout: ParallelLayout) -> ParallelState:
    """ModelOpt's view of ``layout``: amax is reduced over dp x cp (each replica calibrated on other data)
    and, for split tensors, over TP. A size-one dimension has no group (-1), never the world's."""
    dp_cp = layout.group("dp_cp") if layout.dp_size * layout.cp_size > 1 else None
    tp = layout.group("tp") if layout.tp_size > 1 else None
    return ParallelState(dp_cp if dp_cp is not None else NO_GROUP, tp if tp is not None else NO_GROUP)


class _QuantTensorParallelLinear(QuantModule):
    """A quantized tensor-parallel linear: ``output_q(linear(input_q(x), weight_q(W)))`` on this rank's shard."""

    _is_column_parallel = False
    _is_row_parallel = False

    def _setup(self) -> None:
        self._register_temp_attribute("input_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR))
        self._register_temp_attribute("weight_quantizer", TensorQuantizer(QUANT_DESC_8BIT_LINEAR_WEIGHT_PER_ROW))
        self._register_temp_attribute("output_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR))
        self.output_quantizer.disable()
        if getattr(self, "_parallel_state", None) is None:
            # quantize() sets the layout's groups before conversion; alone, the layer knows only its TP group.
            self._parallel_state = ParallelState(NO_GROUP, self.tp_group if self.tp_group is not None else NO_GROUP)

    def linear(self, x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor] = None) -> torch.Tensor:
        y = super().linear(self.input_quantizer(x), self.weight_quantizer(weight), bias)
        return self.output_quantizer(y)


class _QuantColumnParallelLinear(_QuantTensorParallelLinear):
    _is_column_parallel = True


class _QuantRowParallelLinear(_QuantTensorParallelLinear):
    _is_row_parallel = True


def register_layers() -> None:
    """Put our TP linears in ModelOpt's registry (the attention's KV cache: ``kv_quant.register_attention``);
    idempotent. ModelOpt's registry is process-wide by its design; registering the same classes again is a no-op."""
    if ColumnParallelLinear not in QuantModuleRegistry:
        QuantModuleRegistry.register({ColumnParallelLinear: COLUMN_KEY})(_QuantColumnParallelLinear)
    if RowParallelLinear not in QuantModuleRegistry:
        QuantModuleRegistry.register({RowParallelLinear: ROW_KEY})(_QuantRowParallelLinear)


def set_parallel_state(model: nn.Module, layout: ParallelLayout) -> None:
    """Give every quantizable module of ``model`` the layout's groups, before or after conversion."""
    state = parallel_state(layout)
    for module in model.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, SelfAttention)):
            module._parallel_state = state


def _weight_shard(module: nn.Module) -> Optional[TPShard]:
    weight = getattr(module, "weight", None)
    return getattr(weight, "tp_shard", None) if weight is not None else None


def mark_quantizer_shards(model: nn.Module) -> None:
    """Tag quantizer buffers that are split over TP like their layer (``tp_shard``), so checkpoints hold
    them as global tensors and load them into any TP size, as parameters are:

    - a column-parallel layer's per-output-channel weight amax ``[out/tp, 1]`` (split like its weight's rows);
    - a row-parallel layer's input ``pre_quant_scale`` ``[in/tp]`` (SmoothQuant / AWQ; split like its input).

    Everything else is replicated over TP after calibration (per-tensor amax is synchronised, a row-parallel
    layer's per-output-channel weight amax is reduced over TP). Call after every calibration or restore:
    ModelOpt may replace a buffer when it changes shape."""
    for module in model.modules():
        shard = _weight_shard(module)
        if shard is None or not hasattr(module, "weight_quantizer"):
            continue
        amax = getattr(module.weight_quantizer, "_amax", None)
        if (
            isinstance(module, ColumnParallelLinear)
            and amax is not None
            and amax.dim() == 2
            and amax.shape[0] == module.weight.shape[0]
            and amax.shape[0] > 1
        ):
            amax.tp_shard = TPShard(0, shard.stride, (shard.global_shape[0], amax.shape[1]), shard.rank, shard.size)
        scale = getattr(module.input_quantizer, "_pre_quant_scale", None)
        if isinstance(module, RowParallelLinear) and scale is not None and scale.dim() == 1 and shard.size > 1:
            scale.tp_shard = TPShard(0, 1, (shard.global_shape[1],), shard.rank, shard.size)


def quantizer_buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Every ModelOpt quantizer state tensor of ``model`` (amax, pre-quant scales), keyed as in its state dict."""
    names = {name for name, module in model.named_modules() if isinstance(module, TensorQuantizer)}
    return {name: buf for name, buf in model.named_buffers() if name.rsplit(".", 1)[0] in names}

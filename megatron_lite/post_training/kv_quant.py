"""KV-cache quantization: fake-quantize the keys (after RoPE) and values that the generation KV cache holds.

ModelOpt's KV configs (``FP8_KV_CFG``, ``FP8_AFFINE_KV_CFG``, ...) configure quantizers named
``*k_bmm_quantizer`` / ``*v_bmm_quantizer`` that its own attention plugins add around HF attention
kernels. Our :class:`~megatron_lite.core.models.attention.SelfAttention` is registered here with the same
two quantizers, applied in its ``cached_kv`` method -- the one place both the training forward and
generation (prefill and every decode step, before the cache write) pass their K and V through -- so the
presets apply unchanged, calibration sees exactly what the cache will hold, and a fine-tune trains
through the same rounding. Each TP rank holds other heads: ModelOpt's calibration reduces these per-tensor
amax over TP and DP (the module carries the layout's ``ParallelState``), so every rank caches alike.
Registry key: ``megatron_lite_SelfAttention``.
"""

from __future__ import annotations

import torch
from modelopt.torch.quantization.nn import TensorQuantizer
from modelopt.torch.quantization.tensor_quant import QUANT_DESC_8BIT_PER_TENSOR

from megatron_lite.core.models.attention import SelfAttention
from megatron_lite.post_training.modelopt_registry import NO_GROUP, ParallelState, QuantModule, QuantModuleRegistry

ATTENTION_KEY = "megatron_lite_SelfAttention"
KV_CONFIGS = ("FP8_KV_CFG", "FP8_AFFINE_KV_CFG", "NVFP4_KV_CFG", "NVFP4_AFFINE_KV_CFG", "NVFP4_KV_ROTATE_CFG")
"""ModelOpt's KV-cache presets (they configure only the K/V quantizers; combine one with a weight config)."""


class _QuantSelfAttention(QuantModule):
    """SelfAttention whose cached keys and values pass through ``k_bmm_quantizer`` / ``v_bmm_quantizer``
    (disabled until a KV config enables them)."""

    def _setup(self) -> None:
        self._register_temp_attribute("k_bmm_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR))
        self._register_temp_attribute("v_bmm_quantizer", TensorQuantizer(QUANT_DESC_8BIT_PER_TENSOR))
        self.k_bmm_quantizer.disable()
        self.v_bmm_quantizer.disable()
        if getattr(self, "_parallel_state", None) is None:
            tp = self.linear_qkv.tp_group
            self._parallel_state = ParallelState(NO_GROUP, tp if tp is not None else NO_GROUP)

    def cached_kv(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k, v = super().cached_kv(k, v)
        return self.k_bmm_quantizer(k), self.v_bmm_quantizer(v)


def register_attention() -> None:
    """Register SelfAttention with ModelOpt (idempotent; ``quantize`` and ``restore_quantization`` call it beside
    ``modelopt_registry.register_layers``)."""
    if SelfAttention not in QuantModuleRegistry:
        QuantModuleRegistry.register({SelfAttention: ATTENTION_KEY})(_QuantSelfAttention)

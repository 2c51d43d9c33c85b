"""Bytes per element of what each training precision keeps, and what the kernels of a device type save for
backward: the tables the memory estimate multiplies by (the one place to edit when precision handling or a
kernel changes; a new precision is named in :data:`megatron_lite.core.precision.PRECISIONS` first)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from megatron_lite.core.precision import PRECISION_ALIASES, normalize_precision  # noqa: F401  (their old place)


@dataclass(frozen=True)
class PrecisionBytes:
    """Bytes per element of what a precision setting keeps."""

    weight: int
    """Each parameter as the model holds it."""
    grad: int
    """Its gradient (Megatron keeps fp32 "main grads" for half-precision weights)."""
    master: int
    """An fp32 master copy held by the optimizer (0 when the parameters are already fp32)."""
    moment: int
    """Each optimizer moment (Adam keeps two, SGD with momentum one)."""
    compute: int
    """Matmul inputs and outputs (what autocast casts to)."""
    residual: int
    """The residual stream and the norms' inputs (autocast leaves additions and norms in fp32)."""


# Bytes per element for each Lightning precision string (core/precision.py's PRECISIONS), as core/optim keeps them.
# "*-mixed" is torch.autocast over fp32 parameters: weights 4 + grads 4 + Adam 8 = 16 bytes. "*-true" is Megatron's
# layout: half parameters, fp32 main grads, fp32 master copy + Adam: 2 + 4 + 4 + 8 = 18 (DESIGN.md).
# With the distributed optimizer see DISTRIBUTED_*_BYTES: 6 + 12/dp for "*-true", 8 + 12/dp for fp32.
PRECISION_BYTES = {
    "32-true": PrecisionBytes(weight=4, grad=4, master=0, moment=4, compute=4, residual=4),
    "bf16-mixed": PrecisionBytes(weight=4, grad=4, master=0, moment=4, compute=2, residual=4),
    "16-mixed": PrecisionBytes(weight=4, grad=4, master=0, moment=4, compute=2, residual=4),
    "bf16-true": PrecisionBytes(weight=2, grad=4, master=4, moment=4, compute=2, residual=2),
    "16-true": PrecisionBytes(weight=2, grad=4, master=4, moment=4, compute=2, residual=2),
    "64-true": PrecisionBytes(weight=8, grad=8, master=0, moment=8, compute=8, residual=8),
}
# The distributed optimizer (core/optim/distributed.py) keeps a flat fp32 gradient buffer whatever the
# model's dtype, and fp32 main parameters for its shard only beside half-precision weights (fp32 weights
# are their own main copy): 4 + (4 + 8)/dp bytes beyond half weights, 4 + 8/dp beyond fp32 ones.
DISTRIBUTED_MAIN_BYTES = 4
DISTRIBUTED_GRAD_BYTES = 4


@dataclass(frozen=True)
class KernelSaves:
    """What the kernels of a device type keep for backward, where CPU and CUDA differ (measured)."""

    rms_norm_saves_normalized: bool
    """RMSNorm also keeps ``x * rstd`` (an extra ``s b h`` tensor) for the weight gradient."""
    dropout_mask_bytes: Optional[int]
    """Bytes per element of a dropout mask; None: the mask has the activation's dtype."""
    attention_dropout_materializes_scores: bool
    """Attention with dropout falls back to the dense kernel that keeps ``s x s`` scores and masks."""
    dense_attention_in_fp32: bool
    """That dense kernel computes 16-bit attention in fp32 (CPU's math kernel upcasts q, k and v)."""
    fp32_attention_output_is_copied: bool
    """The fp32 kernel's ``[b, s, ...]`` output makes the projection keep its own ``[s b, h]`` copy (b > 1)."""
    attention_rng_bytes: int
    """Bytes the fused attention kernel keeps besides q, k, v, output and logsumexp (CUDA: philox seed, offset)."""
    fused_attention_takes_unequal_widths: bool = True
    """A fused kernel runs values of another head width than queries and keys (multi-latent attention); False:
    the dense kernel runs them (CPU's flash kernel needs equal widths)."""


# Measured with the probe: torch 2.13 on CPU; torch 2.11 on an H200 (cuDNN attention for bf16, the
# memory-efficient kernel for fp32). Other CUDA kernels (flash-attention on older GPUs) may differ by
# one ``s b h`` tensor per layer.
KERNEL_SAVES = {
    "cpu": KernelSaves(
        rms_norm_saves_normalized=True,
        dropout_mask_bytes=None,
        attention_dropout_materializes_scores=True,
        dense_attention_in_fp32=True,
        fp32_attention_output_is_copied=False,
        attention_rng_bytes=0,
        fused_attention_takes_unequal_widths=False,
    ),
    "cuda": KernelSaves(
        rms_norm_saves_normalized=False,
        dropout_mask_bytes=1,
        attention_dropout_materializes_scores=False,
        dense_attention_in_fp32=False,
        fp32_attention_output_is_copied=True,
        attention_rng_bytes=16,
    ),
}


def norm_bytes(
    normalization: str,
    kernels: KernelSaves,
    rows: int,
    width: int,
    input_bytes: int,
    weight_bytes: int,
    stored: Optional[int] = None,
) -> int:
    """What a norm of ``rows`` x ``width`` elements (input of ``input_bytes`` per element, its weight of
    ``weight_bytes``) keeps besides its output (whose dtype is its input's): its input and fp32 statistics (rstd;
    LayerNorm also the mean), CPU's RMSNorm also ``x * rstd``. ``stored``: bytes of the storage the input is a view
    of, kept whole where the norm keeps its input as it is (None: the input itself; 0: held by someone else)."""
    layer_norm = normalization == "LayerNorm"
    stats = rows * 4 * (2 if layer_norm else 1)
    elements = rows * width
    if input_bytes != weight_bytes and not layer_norm:
        # RMSNorm over mixed dtypes runs torch's composite path: it keeps the fp32 upcast input and the fp32
        # normalized tensor it multiplies the weight with (LayerNorm's kernel takes mixed dtypes as they are)
        return 2 * elements * 4 + stats
    normalized = not layer_norm and kernels.rms_norm_saves_normalized
    kept = elements * input_bytes if stored is None else stored
    return kept + (elements * input_bytes if normalized else 0) + stats

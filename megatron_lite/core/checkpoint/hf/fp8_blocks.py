"""Block-scaled FP8 Hugging Face checkpoints (DeepSeek-V3/R1's hub format, also Kimi K2's and the Qwen3 ``-FP8``
releases'), dequantized as they are read.

The format, as ``config.json``'s ``quantization_config`` declares it (``quant_method: "fp8"``, ``fmt: "e4m3"``,
``activation_scheme: "dynamic"``, ``weight_block_size: [r, c]``): a quantized weight ``W`` [rows, cols] is stored
as a ``float8_e4m3fn`` tensor beside ``W_scale_inv`` (float32, [ceil(rows / r), ceil(cols / c)]), and
``W[i, j] = fp8[i, j] * scale_inv[i // r, j // c]`` -- the blocks on the right and bottom edges are partial. The
other tensors (norms, embeddings, the router, ``lm_head``) are stored unquantized, so the FP8 ones are told apart
by their dtype. Dequantized as DeepSeek's ``fp8_cast_bf16.py`` and Megatron-Bridge do: the product in float32,
then cast to the dtype the model is read in.

Why not transformers' dequantization: transformers is not needed to read a directory, and its loader (5.x,
``FineGrainedFP8Config(dequantize=True)``) derives the block from the scale grid (``rows // grid_rows``), which is
wrong whenever the block does not divide a weight (DeepSeek-V3's ``kv_a_proj_with_mqa`` is 576 rows: 4.5 blocks).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Callable, Collection, Mapping, Optional

import torch

from megatron_lite.core.checkpoint.errors import UnsupportedHFModel

SCALE_SUFFIX = "_scale_inv"
FP8_DTYPE = "F8_E4M3"  # the safetensors name of torch.float8_e4m3fn
SCALE_DTYPES = ("F32", "BF16")
_refuse = UnsupportedHFModel.config_option


@dataclasses.dataclass(frozen=True)
class FP8Blocks:
    """How a checkpoint's FP8 weights are scaled: one scale per block of ``rows`` x ``cols`` weights."""

    rows: int  # rows of a block (weight_block_size[0])
    cols: int  # columns of a block (weight_block_size[1])

    def grid(self, shape: tuple[int, ...]) -> tuple[int, int]:
        """The shape of the scales of a weight of ``shape`` (partial edge blocks counted)."""
        return math.ceil(shape[0] / self.rows), math.ceil(shape[1] / self.cols)


def scale_name(weight: str) -> str:
    """The name of the scales of the FP8 tensor ``weight``."""
    return weight + SCALE_SUFFIX


def fp8_blocks(hf: Mapping[str, Any]) -> Optional[FP8Blocks]:
    """The FP8 blocks of an HF ``config.json`` (a dict); None for unquantized weights. Any other quantization is
    refused by name (:class:`UnsupportedHFModel`), before a weight is read."""
    quantization = hf.get("quantization_config")
    if not quantization:
        return None
    method = quantization.get("quant_method", "?") if isinstance(quantization, dict) else "?"
    if method != "fp8" or not isinstance(quantization, dict):
        raise _refuse(
            f"quantization_config (quant_method {method!r})",
            "the weights read are unquantized bf16/fp16/fp32, or block-scaled FP8 (quant_method 'fp8', "
            "DeepSeek-V3's), which is dequantized on import; dequantize the model first",
        )
    if quantization.get("fmt", "e4m3") != "e4m3":
        raise _refuse(f"FP8 fmt {quantization['fmt']!r}", "the FP8 weights read are e4m3 (float8_e4m3fn)")
    if quantization.get("activation_scheme", "dynamic") != "dynamic":
        raise _refuse(
            f"FP8 activation_scheme {quantization['activation_scheme']!r} (calibrated input scales)",
            "only 'dynamic' is read: the weights are dequantized and activations are never quantized here, so "
            "static input scales would be dropped; dequantize the model with the tool that calibrated it",
        )
    block = quantization.get("weight_block_size")
    if not (isinstance(block, list) and len(block) == 2 and all(type(b) is int and b > 0 for b in block)):
        raise _refuse(
            f"FP8 weight_block_size {block!r}",
            "the scales read are per block of [rows, columns] (DeepSeek-V3: [128, 128]); per-tensor or "
            "per-channel FP8 is not read",
        )
    return FP8Blocks(*block)


def dequantized_shapes(
    entries: Mapping[str, tuple[str, tuple[int, ...]]], blocks: Optional[FP8Blocks], where: str
) -> dict[str, tuple[int, ...]]:
    """{name: shape} of the tensors in ``entries`` ({name: (safetensors dtype, shape)}, a directory's headers) as
    they are read: the scales left out. Raise a ValueError naming every FP8 weight without its scales or with
    scales of another grid or dtype, and every scale without an FP8 weight (``where``: the directory)."""
    fp8 = [name for name, (dtype, _) in entries.items() if dtype == FP8_DTYPE]
    if blocks is None:
        if fp8:
            raise ValueError(
                f"{where} holds FP8 tensors ({fp8[:3]}) but its config.json has no quantization_config: add the "
                f'one they were quantized with (DeepSeek-V3\'s: {{"quant_method": "fp8", "fmt": "e4m3", '
                f'"activation_scheme": "dynamic", "weight_block_size": [128, 128]}})'
            )
        return {name: shape for name, (_, shape) in entries.items()}
    problems = []
    for name in fp8:
        shape, scales = entries[name][1], entries.get(scale_name(name))
        if len(shape) != 2:
            problems.append(f"{name} is {len(shape)}-D {shape} (block-scaled FP8 weights are matrices)")
        elif scales is None:
            problems.append(f"{name} has no {scale_name(name)} (a shard is missing or incomplete: download it again)")
        elif scales[1] != blocks.grid(shape):
            problems.append(
                f"{scale_name(name)} is {scales[1]}, but {name} {shape} in [{blocks.rows}, {blocks.cols}] blocks "
                f"has {blocks.grid(shape)} (set weight_block_size in config.json to the block the weights were "
                f"quantized with)"
            )
        elif scales[0] not in SCALE_DTYPES:
            problems.append(f"{scale_name(name)} is {scales[0]} (the scales read are float32 or bfloat16)")
    problems += [
        f"{name} scales {name[: -len(SCALE_SUFFIX)]}, which is not an FP8 ({FP8_DTYPE}) tensor"
        for name in entries
        if name.endswith(SCALE_SUFFIX) and entries.get(name[: -len(SCALE_SUFFIX)], ("",))[0] != FP8_DTYPE
    ]
    if problems:
        raise ValueError(
            f"{where} is not a block-scaled FP8 checkpoint that can be dequantized: " + "; ".join(problems[:8])
        )
    return {name: shape for name, (_, shape) in entries.items() if not name.endswith(SCALE_SUFFIX)}


def dequantize(weight: torch.Tensor, scale_inv: torch.Tensor, blocks: FP8Blocks, dtype: torch.dtype) -> torch.Tensor:
    """``weight`` (FP8) times its block's scale from ``scale_inv``, in float32, cast to ``dtype``."""
    rows, cols = weight.shape
    scale = scale_inv.float().repeat_interleave(blocks.rows, 0)[:rows].repeat_interleave(blocks.cols, 1)[:, :cols]
    return (weight.float() * scale).to(dtype)


def dequantize_shard(
    tensors: Mapping[str, torch.Tensor],
    read_scales: Callable[[Collection[str]], Mapping[str, torch.Tensor]],
    blocks: FP8Blocks,
    dtype: torch.dtype,
) -> dict[str, torch.Tensor]:
    """``tensors`` (one shard's) with each FP8 tensor dequantized to ``dtype``; ``read_scales`` reads the named
    scales (wherever they are stored)."""
    fp8 = [name for name, tensor in tensors.items() if tensor.dtype == torch.float8_e4m3fn]
    scales = read_scales([scale_name(name) for name in fp8]) if fp8 else {}
    missing = [scale_name(name) for name in fp8 if scale_name(name) not in scales]
    if missing:
        raise ValueError(f"the FP8 checkpoint has no scales {missing[:3]} for its FP8 weights; download it again")
    return {
        name: dequantize(tensor, scales[scale_name(name)], blocks, dtype) if name in fp8 else tensor
        for name, tensor in tensors.items()
    }

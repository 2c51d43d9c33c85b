"""Quantized Hugging Face export: a ModelOpt-quantized GPTModel -> an HF directory in ModelOpt's *unified*
checkpoint format (quantized weights + scales in safetensors, ``hf_quant_config.json``, and the same description
as ``quantization_config`` in ``config.json``), which TensorRT-LLM loads as a ``modelopt`` checkpoint, and vLLM
too for FP8 (its ``modelopt`` loader reads FP8/NVFP4 checkpoints and an FP8 KV cache).

How, and why this way. ModelOpt's own ``export_hf_checkpoint`` only walks transformers models, and its per-module
steps are written for HF's separate ``q_proj``/``k_proj``/``v_proj`` and ``gate_proj``/``up_proj``. Our model fuses
both (``linear_qkv`` in Megatron's grouped order, ``linear_fc1 = [gate; up]``), so each quantized linear of ours
is first *split* into the HF modules it stands for -- rows of the weight, rows of a per-channel or per-block amax;
a per-tensor amax, the input quantizer and the SmoothQuant/AWQ ``pre_quant_scale`` are shared, exactly what
ModelOpt's fusion pre-processing makes them before it exports fused-input layers -- and then ModelOpt's own code
writes each part: ``_export_quantized_weight`` (quantized weight, ``weight_scale``, ``input_scale``,
``weight_scale_2``), ``fuse_prequant_layernorm`` (AWQ folds the q/k/v and gate/up ``pre_quant_scale`` into the
preceding RMSNorm, as ModelOpt does for HF models), ``postprocess_state_dict`` (key names) and
``process_layer_quant_config`` / ``convert_hf_quant_config_format`` (the two JSON descriptions). The amax values
are therefore OUR calibration, never re-calibrated on an HF copy, and no transformers model is built (the library
writes HF directories without transformers).

Every row split is exact: quantization is per tensor, per output row or per (row, input block), so the split of a
quantized fused weight is the quantized split weight. Only a full, single-process model (TP = PP = 1) is exported
here; ``megatron-lite convert --to hf`` rebuilds one from a checkpoint written at any layout.
"""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from megatron_lite.core.checkpoint.hf.config import hf_config_from_gpt
from megatron_lite.core.checkpoint.hf.directory import (
    CONFIG,
    DEFAULT_MAX_SHARD_BYTES,
    DTYPES,
    _read_json,
    _write_json,
    atomic_directory,
    copy_side_files,
    write_weights,
)
from megatron_lite.core.checkpoint.hf.weights import _split_qkv, state_to_hf
from megatron_lite.core.models.config import GPTConfig, refuse_mla
from megatron_lite.core.models.moe_config import refuse_experts
from megatron_lite.utils.optional import require

QUANT_CONFIG = "hf_quant_config.json"
# Tensors that stay float32 whatever the export dtype: deployment reads scales as fp32 (TensorRT-LLM uses float
# scaling factors), and a pre_quant_scale rounded to bf16 would no longer be the one the model was calibrated with.
_SCALE_SUFFIXES = (".weight_scale", ".weight_scale_2", ".input_scale", ".pre_quant_scale", ".k_scale", ".v_scale")
# The FP8 KV-cache scale convention of ModelOpt's unified export (amax / 448 for FP8 and NVFP4 caches).
_KV_CACHE_MAX_BOUND = 448.0


class _Part(nn.Module):
    """One HF linear cut out of one of ours: its rows of the weight (and bias) and its own quantizers."""

    def __init__(
        self,
        weight: torch.Tensor,
        bias: Optional[torch.Tensor],
        weight_quantizer: nn.Module,
        input_quantizer: Optional[nn.Module],
    ):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=False)
        self.bias = None if bias is None else nn.Parameter(bias.detach().to(torch.float32).clone(), requires_grad=False)
        self.weight_quantizer = weight_quantizer
        if input_quantizer is not None:
            self.input_quantizer = input_quantizer


class _NormWeight(nn.Module):
    """The RMSNorm weight an AWQ ``pre_quant_scale`` is folded into (ModelOpt's ``fuse_prequant_layernorm``)."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.weight = nn.Parameter(weight.detach().to(torch.float32).clone(), requires_grad=False)


def _quantizers(quantizer: nn.Module) -> list[nn.Module]:
    """The TensorQuantizers inside ``quantizer`` (a SequentialQuantizer holds several, W4A8's weight two)."""
    return list(quantizer) if isinstance(quantizer, nn.Sequential) else [quantizer]


def _split_quantizer(quantizer: nn.Module, rows: Optional[torch.Tensor], total_rows: int) -> nn.Module:
    """A copy of a weight quantizer whose amax covers only ``rows`` (None: all) of a ``total_rows``-row weight.
    A per-tensor amax is shared; a per-channel ``[R, 1]`` or per-block ``[R * blocks, 1]`` amax is cut by row."""
    part = copy.deepcopy(quantizer)
    if rows is None:
        return part
    for q in _quantizers(part):
        amax = getattr(q, "_amax", None)
        if amax is None or amax.numel() == 1:
            continue
        if amax.shape[0] % total_rows != 0:
            raise ValueError(
                f"a weight amax of shape {tuple(amax.shape)} is neither per tensor, per output channel "
                f"nor per block of a {total_rows}-row weight; this quantization cannot be exported"
            )
        per_row = amax.reshape(total_rows, -1)[rows]
        q._amax = per_row.reshape(-1, *amax.shape[1:]).clone()
        # A block quantizer remembers the weight shape it was calibrated on (to lay its amax out for export).
        for attr in ("_amax_shape_for_export", "_original_shape"):
            shape = getattr(q, attr, None)
            if shape is not None and len(shape) > 0 and shape[0] == total_rows:
                setattr(q, attr, type(shape)((len(rows), *shape[1:])))
    return part


def _hf_parts(name: str, config: GPTConfig, rows: int) -> dict[str, Optional[torch.Tensor]]:
    """{HF module name (under ``model.layers.i.``): its rows of our fused weight, None for all} of one of our
    linears, by its name's ending."""
    if name == "self_attention.linear_qkv":
        q, k, v = _split_qkv(torch.arange(rows), config)
        return {"self_attn.q_proj": q, "self_attn.k_proj": k, "self_attn.v_proj": v}
    if name == "self_attention.linear_proj":
        return {"self_attn.o_proj": None}
    if name == "mlp.linear_fc1":
        f = config.ffn_hidden_size
        return {"mlp.gate_proj": torch.arange(0, f), "mlp.up_proj": torch.arange(f, 2 * f)}
    if name == "mlp.linear_fc2":
        return {"mlp.down_proj": None}
    raise ValueError(f"no Hugging Face module corresponds to our {name!r}")


# Our linear -> the RMSNorm in front of it (the one an AWQ pre_quant_scale of a fused-input group is folded into).
_NORM_BEFORE = {"self_attention.linear_qkv": "input_layernorm", "mlp.linear_fc1": "post_attention_layernorm"}
_LAYER_LINEARS = ("self_attention.linear_qkv", "self_attention.linear_proj", "mlp.linear_fc1", "mlp.linear_fc2")


def _enabled(quantizer: Optional[nn.Module]) -> bool:
    return quantizer is not None and any(getattr(q, "is_enabled", False) for q in _quantizers(quantizer))


def has_enabled_quantizer(model: nn.Module) -> bool:
    """Whether any module of ``model`` carries an enabled ModelOpt weight quantizer."""
    return any(_enabled(getattr(m, "weight_quantizer", None)) for m in model.modules())


def has_quantizer_state(state: Mapping[str, torch.Tensor]) -> bool:
    """Whether a saved model state holds ModelOpt quantizer tensors (a quantized model's checkpoint)."""
    return any("_quantizer." in name for name in state)


def _check_exportable(model: nn.Module) -> GPTConfig:
    config = getattr(model, "config", None)
    layout = getattr(model, "layout", None)
    if not isinstance(config, GPTConfig) or layout is None:
        raise TypeError(f"export_quantized_hf takes a GPTModel (GPTModule.model), got {type(model).__name__}")
    refuse_experts(config, "the quantized Hugging Face export")
    refuse_mla(config, "the quantized Hugging Face export")
    if layout.tp_size > 1 or layout.pp_size > 1 or layout.cp_size > 1:
        raise ValueError(
            f"quantized HF export needs the whole model in one process (this one is {layout.describe()}); "
            f"save a checkpoint and run `megatron-lite convert --to hf --input CKPT --output DIR`, which "
            f"rebuilds it at TP=PP=1"
        )
    compressed = [
        name
        for name, p in model.named_parameters()
        if type(p).__name__ == "QTensorWrapper" or not p.is_floating_point()
    ]
    if compressed:
        raise ValueError(
            f"{compressed[0]} holds real-quantized (compressed) data; export the fake-quantized model "
            f"(before modelopt's mtq.compress), whose weights the export quantizes itself"
        )
    output = getattr(model, "output_layer", None)
    if output is not None and _enabled(getattr(output, "weight_quantizer", None)):
        raise ValueError(
            "the output layer is quantized; ModelOpt's presets keep lm_head in high precision and so "
            "does this export: disable its quantizer ('*output_layer*': {'enable': False})"
        )
    if not has_enabled_quantizer(model):
        raise ValueError(
            "the model has no enabled quantizer: quantize it first (megatron_lite.callbacks.Quantize, "
            "`megatron-lite quantize`) or write an unquantized export with save_hf / "
            "`megatron-lite convert --to hf`"
        )
    return config


def _kv_cache_scales(model: nn.Module) -> tuple[dict[str, torch.Tensor], list[nn.Module]]:
    """KV-cache quantizer amaxes of our attention modules, keyed as ModelOpt's HF export keys them before its
    post-processing turns them into ``self_attn.{k,v}_proj.{k,v}_scale`` (amax / 448), and those modules."""
    found: dict[str, torch.Tensor] = {}
    attentions: list[nn.Module] = []
    for name, module in model.named_modules():
        if not name.endswith("self_attention"):
            continue
        hf = "model." + name[: -len("self_attention")] + "self_attn"
        for kind in ("k", "v"):
            quantizer = getattr(module, f"{kind}_bmm_quantizer", None)
            if _enabled(quantizer) and getattr(quantizer, "_amax", None) is not None:
                found[f"{hf}.{kind}_bmm_quantizer._amax"] = quantizer._amax.detach().float().clone()
                if not attentions or attentions[-1] is not module:
                    attentions.append(module)
    return found, attentions


def quantized_hf_state(model: nn.Module) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """(HF tensors, hf_quant_config) of a quantized single-process GPTModel, in ModelOpt's unified format: the
    quantized linears as quantized weights (FP8 ``float8_e4m3fn``, INT8 ``int8``, INT4 two per ``uint8``) with
    their scales, every other tensor float32 (cast it on writing)."""
    require("modelopt", "quantized Hugging Face export")
    import modelopt
    from modelopt.torch.export.quant_utils import (
        fuse_prequant_layernorm,
        get_kv_cache_dtype,
        get_quantization_format,
        get_weight_block_size,
        postprocess_state_dict,
        process_layer_quant_config,
    )
    from modelopt.torch.export.unified_export_hf import _export_quantized_weight

    config = _check_exportable(model)
    modules = dict(model.named_modules())
    plain = {k: v for k, v in model.state_dict().items() if "_quantizer" not in k}
    tensors = {k: v.detach().to(torch.float32) for k, v in state_to_hf(plain, config).items()}
    layer_formats: dict[str, Any] = {}
    exported: dict[str, torch.Tensor] = {}
    for i in range(config.num_layers):
        for ours in _LAYER_LINEARS:
            module = modules[f"layers.{i}.{ours}"]
            weight_quantizer = getattr(module, "weight_quantizer", None)
            parts = _hf_parts(ours, config, module.weight.shape[0])
            prefix = f"model.layers.{i}."
            if weight_quantizer is None:  # never converted by ModelOpt: plain weights, listed as excluded
                layer_formats.update({prefix + hf + ".quantization": None for hf in parts})
                continue
            holders = {
                hf: _Part(
                    module.weight if rows is None else module.weight[rows],
                    None if module.bias is None else (module.bias if rows is None else module.bias[rows]),
                    _split_quantizer(weight_quantizer, rows, module.weight.shape[0]),
                    copy.deepcopy(getattr(module, "input_quantizer", None)),
                )
                for hf, rows in parts.items()
            }
            fmt = get_quantization_format(next(iter(holders.values())))
            for hf, holder in holders.items():
                layer_formats[prefix + hf + ".quantization"] = fmt
                layer_formats[prefix + hf + ".awq_block_size"] = get_weight_block_size(holder)
            if fmt is None:
                continue
            norm = _NORM_BEFORE.get(ours)
            if norm is not None and "awq" in fmt:
                holder_norm = _NormWeight(tensors[prefix + norm + ".weight"])
                fuse_prequant_layernorm(holder_norm, list(holders.values()))
                tensors[prefix + norm + ".weight"] = holder_norm.weight.detach()
            for hf, holder in holders.items():
                _export_quantized_weight(holder, torch.float32)
                for key in (prefix + hf + ".weight", prefix + hf + ".bias"):
                    tensors.pop(key, None)
                # clone: postprocess_state_dict drops a key whose storage another key shares (its tied-weight rule)
                exported.update({f"{prefix}{hf}.{k}": v.detach().clone() for k, v in holder.state_dict().items()})
    layer_formats["lm_head.quantization"] = None  # lm_head (or the tied embedding) stays in high precision
    kv, attentions = _kv_cache_scales(model)
    kv_format = get_kv_cache_dtype(attentions) if attentions else None
    exported.update(kv)
    quant = {
        "producer": {"name": "modelopt", "version": modelopt.__version__},
        "quantization": {"quant_algo": None, "kv_cache_quant_algo": None},
    }
    quant["quantization"].update(process_layer_quant_config(layer_formats))
    if kv_format is not None:
        quant["quantization"]["kv_cache_quant_algo"] = kv_format
    tensors.update(postprocess_state_dict(exported, _KV_CACHE_MAX_BOUND, kv_format))
    return tensors, quant


def _cast(name: str, tensor: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Unquantized floating tensors to the export dtype; quantized weights and scales as they are."""
    if (
        not tensor.is_floating_point()
        or tensor.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
        or name.endswith(_SCALE_SUFFIXES)
    ):
        return tensor.contiguous()
    return tensor.to(dtype).contiguous()


def save_quantized_hf(
    directory: str | os.PathLike,
    model: nn.Module,
    *,
    dtype: str = "bfloat16",
    source_config: Optional[Mapping[str, Any]] = None,
    side_files_from: Optional[str | os.PathLike] = None,
    max_shard_bytes: int = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
) -> Path:
    """Write a ModelOpt-quantized GPTModel (TP=PP=1) as a unified HF checkpoint: ``config.json`` (with
    ``quantization_config``), ``hf_quant_config.json``, ``model.safetensors`` (quantized weights with their
    scales; the rest in ``dtype``, bfloat16 by default as the serving engines run it) and the tokenizer files of
    ``side_files_from``; files of at most ``max_shard_bytes`` with an index past that. Load it with TensorRT-LLM,
    or FP8 with vLLM (``quantization="modelopt"``)."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {dtype!r}")
    from modelopt.torch.export.convert_hf_config import convert_hf_quant_config_format

    tensors, quant = quantized_hf_state(model)  # every error before the directory is touched
    tensors = {name: _cast(name, t, DTYPES[dtype]) for name, t in tensors.items()}
    hf_config = hf_config_from_gpt(model.config, dtype, dict(source_config) if source_config else None)
    hf_config["quantization_config"] = convert_hf_quant_config_format(quant)
    with atomic_directory(directory, overwrite) as tmp:
        write_weights(tmp, tensors, max_shard_bytes)
        if side_files_from is not None:
            copy_side_files(side_files_from, tmp)
        _write_json(tmp / QUANT_CONFIG, quant)
        _write_json(tmp / CONFIG, hf_config)
    return Path(directory)


def read_quant_config(directory: str | os.PathLike) -> Optional[dict[str, Any]]:
    """The ``hf_quant_config.json`` of an exported directory, or None for an unquantized one."""
    path = Path(directory) / QUANT_CONFIG
    return _read_json(path) if path.is_file() else None

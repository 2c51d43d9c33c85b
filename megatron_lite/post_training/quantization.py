"""Quantization of megatron-lite models with nvidia-modelopt: PTQ, the QAT set-up, KV-cache quantization,
perplexity, and the quantizer state our checkpoints carry.

``quantize(module, "INT8_SMOOTHQUANT_CFG", calibration_batches)`` converts our layers (registered in
``modelopt_registry``), calibrates on the batches -- through the module's own engine schedule, so it runs
under any TP/DP/CP/PP layout, each stage calibrating its layers -- and ModelOpt synchronises amax over DP and
over TP where a tensor is split. The model stays fake-quantized and trainable: fake quantization passes
gradients straight through, so fitting it afterwards is quantization-aware training.

Configs are ModelOpt's, named by their full ``*_CFG`` names; ``kv_cache="FP8_KV_CFG"`` adds one of its
KV-cache presets (``kv_quant``). Formats with FP4/FP6 elements or shared block scales (NVFP4, MX*) run only in
ModelOpt's CUDA kernels: asked for on CPU they fail at once with an error saying so.

Checkpoints: a quantized model carries its recipe (config names and ModelOpt's version) as JSON bytes in a
uint8 buffer (:data:`RECIPE_BUFFER`, the same on every rank of every layout) and its quantizers' tensors
(amax, pre-quant scales) as buffers, so DCP checkpoints, the forked fit's hand-back and ``from_pretrained``
carry them with the weights (split ones as global tensors, like parameters). Loading rebuilds the
quantizers from the recipe and the saved tensors' shapes (:func:`restore_quantization`, no calibration),
then fills the tensors. Nothing is pickled.
"""

from __future__ import annotations

import copy
import json
import math
from typing import Any, Callable, Iterable, Optional, Union

import torch
from torch import nn

from megatron_lite.core.checkpoint.resume.entries import QUANTIZATION_RECIPE
from megatron_lite.core.models.config import refuse_mla
from megatron_lite.core.models.moe_config import refuse_experts
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.schedules import gpt_loss
from megatron_lite.utils.optional import require

STATE_FORMAT = "megatron-lite-quantization/1"
RECIPE_BUFFER = QUANTIZATION_RECIPE
"""Buffer of a quantized model holding its recipe as JSON bytes (see :func:`encode_recipe`)."""

Batch = Union[dict, torch.Tensor]


def _mtq():
    return require("modelopt.torch.quantization", "megatron-lite quantization")


def _register_with_modelopt() -> None:
    """Our TP linears (:mod:`modelopt_registry`) and the attention's KV-cache quantizers (:mod:`kv_quant`) in
    ModelOpt's registry; idempotent. Both modules import modelopt, so they are imported when quantizing."""
    from megatron_lite.post_training import kv_quant, modelopt_registry

    modelopt_registry.register_layers()
    kv_quant.register_attention()


def available_configs() -> list[str]:
    """The ModelOpt config names :func:`quantize` accepts (``INT8_SMOOTHQUANT_CFG``, ``FP8_DEFAULT_CFG``, ...)."""
    from megatron_lite.post_training.kv_quant import KV_CONFIGS

    mtq = _mtq()
    return sorted(
        n for n in dir(mtq) if n.endswith("_CFG") and isinstance(getattr(mtq, n), dict) and n not in KV_CONFIGS
    )


def available_kv_configs() -> list[str]:
    """The KV-cache presets ``kv_cache=`` accepts."""
    from megatron_lite.post_training.kv_quant import KV_CONFIGS

    mtq = _mtq()
    return [n for n in KV_CONFIGS if isinstance(getattr(mtq, n, None), dict)]


def resolve_config(config: Optional[str], kv_cache: Optional[str] = None) -> dict:
    """ModelOpt's config dict for ``config`` (a ``*_CFG`` name; None: only the KV cache) plus the KV preset
    ``kv_cache``. Unknown names fail listing the valid ones."""
    mtq = _mtq()
    kv_names = available_kv_configs()
    if config is None and kv_cache is None:
        raise ValueError(
            f"nothing to quantize: give a config ({', '.join(available_configs())}) and/or "
            f"kv_cache ({', '.join(kv_names)})"
        )
    if config is not None:
        if config in kv_names:
            raise ValueError(
                f"{config} configures only the KV cache: pass kv_cache={config!r} (with config=None, or "
                f"with a weight config such as 'FP8_DEFAULT_CFG')"
            )
        if config not in available_configs():
            raise ValueError(f"unknown quantization config {config!r}; valid names: {', '.join(available_configs())}")
        cfg = copy.deepcopy(getattr(mtq, config))
    else:
        cfg = {"quant_cfg": [{"quantizer_name": "*", "enable": False}], "algorithm": "max"}
    if kv_cache is not None:
        if kv_cache not in kv_names:
            raise ValueError(f"unknown KV-cache config {kv_cache!r}; valid names: {', '.join(kv_names)}")
        cfg["quant_cfg"] = list(cfg["quant_cfg"]) + copy.deepcopy(list(getattr(mtq, kv_cache)["quant_cfg"]))
    cfg.setdefault("algorithm", "max")
    return cfg


def needs_cuda(cfg: dict) -> bool:
    """Whether ``cfg`` enables a format ModelOpt only emulates in CUDA kernels: FP4/FP6 elements (NVFP4, MXFP4,
    MXFP6) or shared block scales (the MX formats, ``scale_bits``)."""
    for entry in cfg.get("quant_cfg", []):
        attrs = entry.get("cfg") if isinstance(entry, dict) else None
        for attr in attrs if isinstance(attrs, list) else [attrs]:
            if not isinstance(attr, dict) or attr.get("enable") is False:
                continue
            bits = attr.get("num_bits")
            if isinstance(bits, (tuple, list)) and tuple(bits) in ((2, 1), (3, 2), (2, 3)):
                return True
            if isinstance(attr.get("block_sizes"), dict) and "scale_bits" in attr["block_sizes"]:
                return True
    return False


def _needs_data(cfg: dict) -> bool:
    """Whether ``cfg`` calibrates on activations (an algorithm beyond weight max, or an enabled activation or KV
    quantizer); weight-only max calibration reads the weights alone."""
    if cfg.get("algorithm") not in (None, "max"):
        return True
    return any(
        entry.get("quantizer_name", "").endswith(("input_quantizer", "bmm_quantizer"))
        and entry.get("enable", True) is not False
        and entry.get("cfg") is not None
        for entry in cfg["quant_cfg"]
    )


def _check_device(model: nn.Module, cfg: dict, name: str) -> None:
    param = next(model.parameters(), None)
    on_cuda = param is not None and param.device.type == "cuda"
    if needs_cuda(cfg) and not on_cuda:
        raise ValueError(
            f"{name} (FP4/FP6 elements or MX block scales) runs only in ModelOpt's CUDA kernels and the "
            f"model is on {param.device if param is not None else 'no device'}; run it on a GPU "
            f"(accelerator='gpu'), or pick a CPU format: INT8_SMOOTHQUANT_CFG, INT8_DEFAULT_CFG, "
            f"FP8_DEFAULT_CFG, INT4_AWQ_CFG, W4A8_AWQ_BETA_CFG"
        )


def _target(target: Any) -> tuple[nn.Module, ParallelLayout, Optional[Any]]:
    """(model, layout, module or None) for a GPTModule-like module or a bare GPTModel."""
    model = getattr(target, "model", None)
    if isinstance(model, nn.Module) and hasattr(target, "run_schedule"):
        return model, target.parallel_layout, target
    if hasattr(target, "run_schedule"):
        raise ValueError(
            f"{type(target).__name__} has no model yet: quantize it after configure_model() (a Trainer "
            f"builds it), or load one with GPTModule.from_pretrained(path)"
        )
    if not isinstance(target, nn.Module):
        raise TypeError(f"quantize takes a GPTModule or a GPTModel, got {type(target).__name__}")
    layout = getattr(target, "layout", None) or ParallelLayout.single()
    return target, layout, None


def _as_batch(batch: Batch) -> dict:
    if isinstance(batch, torch.Tensor):
        return {"tokens": batch}
    if isinstance(batch, dict) and "tokens" in batch:
        return batch
    raise TypeError(
        "a calibration/evaluation batch is {'tokens': LongTensor[b, s+1], ...} or such a tensor, got "
        f"{type(batch).__name__}"
    )


def _run_batches(model: nn.Module, module: Optional[Any], batches: list[dict]) -> tuple[float, float]:
    """Forward every batch (no gradients, eval mode restored after); (sum of token losses, tokens)."""
    was_training = model.training
    model.eval()
    total, tokens = 0.0, 0.0
    try:
        with torch.no_grad():
            for batch in batches:
                if module is not None:  # the module's engine: any layout, pipeline stages included
                    step = module.run_schedule(batch, forward_only=True)
                    total += float(step.loss) * float(step.num_tokens)
                    tokens += float(step.num_tokens)
                else:
                    loss_sum, count = gpt_loss(model, batch)
                    total, tokens = total + float(loss_sum), tokens + float(count)
    finally:
        model.train(was_training)
    return total, tokens


def perplexity(target: Any, batches: Iterable[Batch]) -> float:
    """``exp`` of the mean next-token loss over every loss token of ``batches`` (``{"tokens": [b, s+1]}``) for a
    GPTModule (through its engine: inside a Trainer under any layout, every rank calling it with its data
    share, or alone) or a one-process GPTModel."""
    model, _, module = _target(target)
    batches = [_as_batch(b) for b in batches]
    if not batches:
        raise ValueError("perplexity needs at least one batch")
    total, tokens = _run_batches(model, module, batches)  # through the engine: sums over the global batch
    return math.exp(total / tokens)


def quantize(
    target: Any,
    config: Optional[str] = "INT8_SMOOTHQUANT_CFG",
    calibration: Optional[Iterable[Batch]] = None,
    *,
    kv_cache: Optional[str] = None,
    forward_loop: Optional[Callable[[nn.Module], Any]] = None,
) -> Any:
    """Quantize ``target`` (a GPTModule with its model, or a GPTModel) in place with ModelOpt's ``config``
    (a ``*_CFG`` name, see :func:`available_configs`) and optionally the KV-cache preset ``kv_cache``,
    calibrating on ``calibration`` (batches ``{"tokens": [b, s+1]}``; each DP rank its own share) or with
    ``forward_loop(model)``. Weight-only configs need no data. Returns ``target``.

    Inside a Trainer every rank must call it (calibration synchronises amax over DP and TP)."""
    model, layout, module = _target(target)
    # ModelOpt's registry holds our dense linear layers, not the experts' grouped GEMMs
    refuse_experts(getattr(model, "config", None), "quantization (ModelOpt)")
    refuse_mla(getattr(model, "config", None), "quantization (ModelOpt)")
    mtq = _mtq()
    from megatron_lite.post_training import modelopt_registry as registry

    if is_quantized(model):
        raise ValueError(
            f"the model is already quantized ({quantization_recipe(model)}); quantize the unquantized "
            f"model (load it again)"
        )
    cfg = resolve_config(config, kv_cache)
    _check_device(model, cfg, config or kv_cache)
    batches = [_as_batch(b) for b in calibration] if calibration is not None else None
    if forward_loop is None and batches:
        forward_loop = lambda _model: _run_batches(model, module, batches)  # noqa: E731
    if forward_loop is None and _needs_data(cfg):
        raise ValueError(
            f"{config or kv_cache} calibrates activations: pass calibration batches "
            f"(e.g. calibration=[next(iter(datamodule.train_dataloader()))])"
        )
    _register_with_modelopt()
    registry.set_parallel_state(model, layout)
    mtq.quantize(model, cfg, forward_loop)
    registry.mark_quantizer_shards(model)
    _set_recipe(model, config, kv_cache)
    return target


def is_quantized(model: nn.Module) -> bool:
    """Whether :func:`quantize` (or :func:`restore_quantization`) has converted ``model``."""
    return isinstance(getattr(model, RECIPE_BUFFER, None), torch.Tensor)


def quantization_recipe(model: nn.Module) -> Optional[dict]:
    """What a quantized ``model`` was quantized with (``{"format", "config", "kv_cache", "modelopt_version"}``),
    None if it is not quantized."""
    buf = getattr(model, RECIPE_BUFFER, None)
    return decode_recipe(buf) if isinstance(buf, torch.Tensor) else None


def encode_recipe(config: Optional[str], kv_cache: Optional[str]) -> torch.Tensor:
    """The recipe as JSON bytes in a uint8 tensor: the same on every rank of every layout, so checkpoints
    (DCP, the forked fit's hand-back, from_pretrained) carry it with the weights and never pickle it."""
    import modelopt

    text = json.dumps(
        {"format": STATE_FORMAT, "config": config, "kv_cache": kv_cache, "modelopt_version": modelopt.__version__},
        sort_keys=True,
    )
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def decode_recipe(tensor: torch.Tensor) -> dict:
    """The recipe :func:`encode_recipe` wrote; a clear error for anything else."""
    try:
        recipe = json.loads(bytes(tensor.detach().cpu().to(torch.uint8).tolist()).decode())
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"the checkpoint's {RECIPE_BUFFER} entry is not a quantization recipe: {error}") from None
    if not isinstance(recipe, dict) or recipe.get("format") != STATE_FORMAT:
        raise ValueError(f"the checkpoint's {RECIPE_BUFFER} entry is not a {STATE_FORMAT} recipe")
    return recipe


def _set_recipe(model: nn.Module, config: Optional[str], kv_cache: Optional[str]) -> None:
    param = next(model.parameters(), None)
    recipe = encode_recipe(config, kv_cache)
    model.register_buffer(RECIPE_BUFFER, recipe.to(param.device) if param is not None else recipe)


def quantizer_tensor_names(names: Iterable[str]) -> list[str]:
    """The quantizer tensors (amax, pre-quant scales, ...) among a state's ``names``."""
    return [n for n in names if _split_quantizer_name(n) is not None]


def _split_quantizer_name(name: str) -> Optional[tuple[str, str]]:
    """(layer, quantizer kind) of a quantizer tensor's name: ``layers.0.mlp.linear_fc1.weight_quantizer._amax`` and
    (a ModelOpt SequentialQuantizer, W4A8) ``...weight_quantizer.0._amax`` give ``("layers.0.mlp.linear_fc1",
    "weight_quantizer")``; None for other names."""
    parts = name.split(".")[:-1]
    for i in range(len(parts) - 1, -1, -1):
        if parts[i].endswith("_quantizer"):
            return ".".join(parts[:i]), parts[i]
    return None


def restore_quantization(
    model: nn.Module, recipe: dict, tensor_shapes: dict[str, tuple], layout: Optional[ParallelLayout] = None
) -> nn.Module:
    """Rebuild in the unquantized ``model`` (built for ``layout``, any TP size) the quantizers of a checkpoint:
    ``recipe`` (see :func:`decode_recipe`) configures them as :func:`quantize` did, ``tensor_shapes`` (the
    checkpoint's quantizer tensors, name -> global shape) says which hold calibrated tensors; each gets a
    placeholder of this rank's shape that loading the checkpoint then fills. No calibration, no data."""
    mtq = _mtq()
    from megatron_lite.post_training import modelopt_registry as registry

    if is_quantized(model):
        raise ValueError("the model is already quantized: restore into a freshly built model")
    layout = layout or getattr(model, "layout", None) or ParallelLayout.single()
    cfg = resolve_config(recipe["config"], recipe["kv_cache"])
    _register_with_modelopt()
    registry.set_parallel_state(model, layout)
    mtq.quantize(model, {**cfg, "algorithm": None}, None)  # the quantizers as configured, nothing calibrated
    quantizers = _quantizers(model)
    device = _device(model)
    for name, global_shape in tensor_shapes.items():
        owner_name, buffer = name.rsplit(".", 1)
        if owner_name not in quantizers:
            continue  # a pipeline stage holds only its layers' quantizers
        layer_name, quantizer_name = _split_quantizer_name(name)
        quantizer = quantizers[owner_name]
        local = _local_shape(model.get_submodule(layer_name), quantizer_name, buffer, tuple(global_shape))
        if buffer == "_pre_quant_scale":
            quantizer.pre_quant_scale = torch.ones(local, device=device)
        elif buffer == "_amax":
            quantizer.amax = torch.ones(local, device=device)
        else:
            quantizer.register_buffer(buffer, torch.zeros(local, device=device))
    registry.mark_quantizer_shards(model)
    _set_recipe(model, recipe["config"], recipe["kv_cache"])
    return model


def restore_from_state(
    model: nn.Module, state: dict[str, torch.Tensor], prefix: str = "", layout: Optional[ParallelLayout] = None
) -> bool:
    """If ``state`` (full tensors keyed ``prefix`` + the model's names) is a quantized model's, quantize the
    unquantized ``model`` like it (ready for the tensors to be loaded) and return True."""
    key = prefix + RECIPE_BUFFER
    if key not in state or is_quantized(model):
        return False
    shapes = {n[len(prefix) :]: tuple(state[n].shape) for n in quantizer_tensor_names(state) if n.startswith(prefix)}
    restore_quantization(model, decode_recipe(state[key]), shapes, layout)
    return True


def _quantizers(model: nn.Module) -> dict[str, nn.Module]:
    from modelopt.torch.quantization.nn import TensorQuantizer

    return {name: m for name, m in model.named_modules() if isinstance(m, TensorQuantizer)}


def _device(model: nn.Module) -> torch.device:
    param = next(model.parameters(), None)
    return param.device if param is not None else torch.device("cpu")


def _local_shape(owner: nn.Module, quantizer: str, buffer: str, global_shape: tuple) -> tuple:
    """This rank's shape of a quantizer tensor saved at ``global_shape`` (the split ones: see
    ``modelopt_registry.mark_quantizer_shards``)."""
    from megatron_lite.core.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

    shard = getattr(getattr(owner, "weight", None), "tp_shard", None)
    if shard is None:
        return global_shape
    if isinstance(owner, ColumnParallelLinear) and quantizer == "weight_quantizer" and buffer == "_amax":
        if len(global_shape) == 3 and shard.stride > 1:  # a fused gate/up amax is saved in blocks, as its weight
            global_shape = (global_shape[0] * global_shape[1], global_shape[2])
        if len(global_shape) == 2 and global_shape[0] == shard.global_shape[0] and global_shape[0] > 1:
            return (global_shape[0] // shard.size, global_shape[1])
    if shard.size == 1:
        return global_shape
    if (
        isinstance(owner, RowParallelLinear)
        and quantizer == "input_quantizer"
        and buffer == "_pre_quant_scale"
        and len(global_shape) == 1
    ):
        return (global_shape[0] // shard.size,)
    return global_shape


def read_checkpoint_quantization(path: Any) -> Optional[tuple[dict, dict[str, tuple]]]:
    """(recipe, quantizer tensor name -> global shape) of one of our checkpoints if it holds a quantized model,
    else None; reads the metadata and the small recipe tensor only."""
    from megatron_lite.core.checkpoint.format.safe_reader import read_dcp_metadata
    from megatron_lite.core.checkpoint.format.sharded import resolve_checkpoint
    from megatron_lite.core.checkpoint.full.reader import MODEL_PREFIX, read_model_tensors

    path = resolve_checkpoint(path)
    entries = read_dcp_metadata(path / ".metadata").state_dict_metadata
    prefix = "model." + MODEL_PREFIX
    if prefix + RECIPE_BUFFER not in entries:
        return None
    recipe = decode_recipe(read_model_tensors(path, prefix=MODEL_PREFIX + RECIPE_BUFFER)[""])
    names = quantizer_tensor_names(k[len(prefix) :] for k in entries if k.startswith(prefix))
    return recipe, {name: tuple(entries[prefix + name].size) for name in names}

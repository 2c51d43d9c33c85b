"""Hugging Face PEFT LoRA adapters <-> our fused LoRA adapters (plain PyTorch: reads and writes PEFT's files
itself, never imports peft).

PEFT adapts HF's seven projections one by one (``q_proj``, ``k_proj``, ``v_proj``, ``o_proj``, ``gate_proj``,
``up_proj``, ``down_proj``), each with its own ``lora_A`` [r, in] and ``lora_B`` [out, r] and the scale
``lora_alpha / r``; ours adapt Megatron's fused layers (``linear_qkv`` = q, k, v in Megatron's grouped row order,
``linear_fc1`` = [gate; up], ``linear_proj`` = o, ``linear_fc2`` = down) with one ``A`` [dim, in] and ``B`` [out,
dim] each and the scale ``alpha / dim``.

- **Export** (:func:`save_peft_adapter`): one A serves all parts of a fused layer, so each part gets ``lora_A = A``
  and ``lora_B`` = its rows of ``B`` (q/k/v rows un-grouped as the base weight is by
  :mod:`~megatron_lite.core.checkpoint.hf.weights`), ``r = dim``, ``lora_alpha = alpha``: exactly our function.
- **Import** (:func:`load_peft_adapter`): the parts' A differ, so a fused layer's adapter **stacks their ranks**:
  ``A = [A_q; A_k; A_v]`` and ``B`` block-structured (q's rows take q's rank columns, zeros elsewhere), so that
  ``B A = [B_q A_q; B_k A_k; B_v A_v]`` exactly. Every adapter of a model shares one rank (``LoRAConfig.dim``), so
  all are widened to ``dim = r * P`` (``P``: the most parts any adapted fused layer has; unused rank rows of A and
  columns of B are zeros) and ``alpha = lora_alpha * P`` keeps the scale ``lora_alpha / r``. Zero rows and columns
  stay zero under training (their gradients are zero); the zero blocks of B do not: a further fine-tune trains the
  fused adapter as a whole (a rank-``dim`` adapter of the whole layer, which exports exactly again).

On a DeepSeek-V3 (multi-latent attention) model each of our MLA projections is one HF module (``q_proj`` or
``q_a_proj``/``q_b_proj``, ``kv_a_proj_with_mqa``, ``kv_b_proj``, ``o_proj``). The rows of ``lora_B`` that produce
rotated channels (the queries' and the RoPE key's) are permuted exactly as the base weight's rows are
(:mod:`~megatron_lite.core.checkpoint.hf.deepseek`: DeepSeek's interleaved pairs against our halves), so ``B A``
stays the weight's update. Its MLP adapters have no PEFT form here: PEFT (>= 0.18 with transformers 5) turns
``gate_proj``/``up_proj``/``down_proj`` targets on a DeepSeek-V3 into the routed experts' fused 3D parameters
(``target_parameters``), dropping the dense layers' and the shared experts' -- refused both ways, merge them instead.

What PEFT expresses and one fused adapter cannot is refused by name: DoRA, rsLoRA, biases, per-module ranks or
alphas, trained copies of other modules (``modules_to_save``), adapters on other modules, pickled weights.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from pathlib import Path
from typing import Any, Optional

import torch
from torch import nn

from megatron_lite.core.checkpoint.format.safetensors_io import load_safetensors, save_safetensors
from megatron_lite.core.checkpoint.hf.deepseek import _names as mla_names
from megatron_lite.core.checkpoint.hf.deepseek import _rotated_rows, attention_shapes
from megatron_lite.core.checkpoint.hf.weights import _fuse_qkv, _gate_up, _split_qkv
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.peft import LoRAConfig, adapters, apply_lora, lora_recipe
from megatron_lite.core.peft.config import TARGET_NAMES
from megatron_lite.core.peft.lora import adaptable_layer_names

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
"""What PEFT's saved names put before the base model's module names (``base_model.model.model.layers.0...``)."""

Parts = dict[str, tuple[str, tuple[str, ...]]]
"""Our layer (under ``layers.{i}.``) -> its HF block and projections, in the order their rows lie in our weight."""

_MLP_PARTS: Parts = {
    "mlp.linear_fc1": ("mlp", ("gate_proj", "up_proj")),
    "mlp.linear_fc2": ("mlp", ("down_proj",)),
}
_PARTS: Parts = {
    "self_attention.linear_qkv": ("self_attn", ("q_proj", "k_proj", "v_proj")),
    "self_attention.linear_proj": ("self_attn", ("o_proj",)),
    **_MLP_PARTS,
}
_PEFT_KEY = re.compile(re.escape(PEFT_PREFIX) + r"model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+)\.lora_(A|B)\.weight")


def _parts(config: GPTConfig) -> Parts:
    """Our layers of a model of ``config`` that have a PEFT form and their HF projections: a Llama-family layer's,
    or a DeepSeek-V3 layer's attention (each MLA projection one HF module; see the module docstring for its MLP)."""
    if not config.multi_latent_attention:
        return _PARTS
    return {f"self_attention.{ours}": ("self_attn", (hf,)) for hf, ours in mla_names(config)}


def _projections(parts: Parts) -> list[str]:
    """The HF projection names of ``parts``, each once, in their order."""
    return list(dict.fromkeys(part for _, names in parts.values() for part in names))


# adapter_config.json fields whose non-default values change the adapter's function in a way ours cannot express.
_UNSUPPORTED: dict[str, tuple[Any, str]] = {
    "use_dora": (False, "DoRA (weight-decomposed LoRA) adds a magnitude vector our adapters do not have"),
    "use_rslora": (False, "rsLoRA scales by lora_alpha / sqrt(r), ours by alpha / dim"),
    "bias": ("none", "adapter biases are not part of our adapters"),
    "lora_bias": (False, "a bias on lora_B is not part of our adapters"),
    "fan_in_fan_out": (False, "transposed (Conv1D) weights are not a Llama-family layout"),
    "rank_pattern": ({}, "per-module ranks differ from the one rank our adapters share"),
    "alpha_pattern": ({}, "per-module alphas differ from the one alpha our adapters share"),
    "modules_to_save": (None, "fully trained copies of other modules are not adapters"),
    "layer_replication": (None, "replicated layers change the base model's depth"),
    "target_parameters": (None, "adapters on raw parameters (MoE experts) are not supported"),
    "trainable_token_indices": (None, "trainable token embeddings are not adapters"),
    "use_qalora": (False, "QA-LoRA pools the adapter's input"),
    "alora_invocation_tokens": (None, "activated LoRA switches on at invocation tokens"),
}


def save_peft_adapter(
    directory: str | os.PathLike,
    model: nn.Module,
    config: GPTConfig,
    *,
    dtype: torch.dtype = torch.float32,
    base_model_name_or_path: Optional[str] = None,
) -> list[str]:
    """Write the adapters of ``model`` (one process, adapted by :func:`~megatron_lite.core.peft.apply_lora`) into
    ``directory`` as PEFT's ``adapter_config.json`` and ``adapter_model.safetensors`` (see the module docstring);
    returns the HF module names adapted. The caller makes the write atomic."""
    recipe = lora_recipe(model)
    if recipe is None:
        raise ValueError("the model has no LoRA adapters to export")
    lora = recipe[0]
    tensors: dict[str, torch.Tensor] = {}
    modules: list[str] = []
    parts_of = _parts(config)
    our_layer = re.compile(r"layers\.(\d+)\.(" + "|".join(map(re.escape, parts_of)) + ")")
    for name, adapter in adapters(model):
        match = our_layer.fullmatch(name)
        if match is None:
            raise ValueError(
                f"the adapter on {name} has no PEFT counterpart (PEFT adapts the projections of attention and of a "
                f"dense MLP; on a DeepSeek-V3 those of attention only); fold the adapters in with "
                f"`convert --to hf --merge-lora` instead"
            )
        index, ours = match.groups()
        block, parts = parts_of[ours]
        a, b = adapter.linear_in.weight.detach(), adapter.linear_out.weight.detach()
        rows: tuple[torch.Tensor, ...]
        if ours == "self_attention.linear_qkv":
            rows = _split_qkv(b, config)
        elif ours == "mlp.linear_fc1":
            assert config.ffn_hidden_size is not None  # resolved by GPTConfig.__post_init__
            rows = _gate_up(b, config.ffn_hidden_size, (b.shape[-1],))
        else:
            order = _rotated_rows(config, parts[0]) if config.multi_latent_attention else None
            rows = (b[torch.argsort(order)] if order is not None else b,)  # DeepSeek's interleaved RoPE rows
        for part, b_rows in zip(parts, rows):
            module = f"model.layers.{index}.{block}.{part}"
            modules.append(module)
            tensors[f"{PEFT_PREFIX}{module}.lora_A.weight"] = a.to("cpu", dtype).contiguous()
            tensors[f"{PEFT_PREFIX}{module}.lora_B.weight"] = b_rows.to("cpu", dtype).contiguous()
    document: dict[str, Any] = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora.dim,
        "lora_alpha": lora.alpha,
        # PEFT drops the adapter's input; a "post" dropout of ours has no PEFT form (it only matters in training)
        "lora_dropout": lora.dropout,
        "target_modules": _target_modules(modules, config, parts_of),
        "bias": "none",
        "use_dora": False,
        "use_rslora": False,
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": None,
        "rank_pattern": {},
        "alpha_pattern": {},
    }
    directory = Path(directory)
    save_safetensors(tensors, directory / ADAPTER_WEIGHTS, metadata={"format": "pt"})
    (directory / ADAPTER_CONFIG).write_text(json.dumps(document, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    return modules


def _target_modules(modules: list[str], config: GPTConfig, parts_of: Parts) -> list[str] | str:
    """PEFT's ``target_modules`` selecting exactly ``modules``: the projections' names when every layer has them
    (and no MoE block holds a module of the same name), else a regular expression PEFT matches against full
    module names."""
    adapted = set(modules)
    names = sorted({m.rsplit(".", 1)[-1] for m in modules}, key=_projections(parts_of).index)
    every_layer = all(
        f"model.layers.{i}.{block}.{part}" in adapted
        for i in range(config.num_layers)
        for block, parts in parts_of.values()
        for part in parts
        if part in names
    )
    if every_layer and config.num_moe_experts is None:
        return names
    return "|".join(re.escape(m) for m in modules)


def read_peft_config(directory: str | os.PathLike) -> dict[str, Any]:
    """The ``adapter_config.json`` of a PEFT adapter directory, checked to be a LoRA adapter ours can hold."""
    directory = Path(directory)
    path = directory / ADAPTER_CONFIG
    if not path.is_file():
        raise FileNotFoundError(
            f"{directory} is not a PEFT adapter directory (no {ADAPTER_CONFIG}); pass the folder "
            f"PeftModel.save_pretrained wrote"
        )
    try:
        document = json.loads(path.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as error:
        raise ValueError(f"{path} is not JSON: {error}") from None
    if not isinstance(document, dict):
        raise ValueError(f"{path} is not a JSON object")
    if document.get("peft_type") != "LORA":
        raise ValueError(f"{path}: peft_type {document.get('peft_type')!r} is not supported; only LORA adapters are")
    for field, (default, why) in _UNSUPPORTED.items():
        value = document.get(field)
        if value not in (default, None, {}, [], False):
            raise ValueError(f"{path}: {field}={value!r} is not supported ({why}); train the adapter without it")
    for field in ("r", "lora_alpha"):
        value = document.get(field)
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value <= 0:
            raise ValueError(f"{path}: {field}={value!r} must be a positive number")
    return document


@dataclasses.dataclass
class _Parts:
    """One of our layers' PEFT adapters: part name -> (lora_A, lora_B)."""

    a: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    b: dict[str, torch.Tensor] = dataclasses.field(default_factory=dict)


def load_peft_adapter(
    model: nn.Module, directory: str | os.PathLike, config: GPTConfig, seed: int, *, interleaved_rope: bool = True
) -> LoRAConfig:
    """Give ``model`` (one process, the base the adapter was trained on, without adapters) the LoRA adapters of the
    PEFT directory ``directory``, exactly (see the module docstring); returns the :class:`LoRAConfig` they have.
    ``interleaved_rope``: on a DeepSeek-V3 base, whether its HF weights rotate interleaved channel pairs
    (``rope_interleave``, what ``convert --to hf`` writes): the adapters' rotated rows are then permuted as its."""
    if lora_recipe(model) is not None:
        raise ValueError("the model has LoRA adapters already; load a PEFT adapter onto a base model")
    directory = Path(directory)
    document = read_peft_config(directory)
    weights = directory / ADAPTER_WEIGHTS
    if not weights.is_file():
        found = [p.name for p in directory.iterdir() if p.name.startswith("adapter_model")]
        raise FileNotFoundError(
            f"{directory} has no {ADAPTER_WEIGHTS}"
            + (f" ({found[0]} is never read: a pickle can run code)" if found else "")
            + "; save the adapter with PeftModel.save_pretrained(..., safe_serialization=True)"
        )
    tensors, _ = load_safetensors(weights)
    rank, lora_alpha = int(document["r"]), float(document["lora_alpha"])
    layers: dict[str, _Parts] = {}
    parts_of = _parts(config)
    ours_of = {(block, part): ours for ours, (block, parts) in parts_of.items() for part in parts}
    for key, tensor in tensors.items():
        match = _PEFT_KEY.fullmatch(key)
        ours = ours_of.get((match.group(2), match.group(3))) if match else None
        if match is None or ours is None or int(match.group(1)) >= config.num_layers:
            raise ValueError(
                f"{weights}: {key!r} is not an adapter ours can hold; only the projections "
                f"{_projections(parts_of)} of the model's {config.num_layers} layers "
                f"(base_model.model.model.layers.N.<block>.<proj>.lora_A/B) are"
            )
        ab = match.group(4)
        if tensor.dim() != 2 or tensor.shape[0 if ab == "A" else 1] != rank:
            raise ValueError(
                f"{weights}: {key} has shape {tuple(tensor.shape)}, not rank r={rank} of {ADAPTER_CONFIG} "
                f"(per-module ranks are not supported)"
            )
        parts = layers.setdefault(f"layers.{match.group(1)}.{ours}", _Parts())
        order = _rotated_rows(config, match.group(3)) if config.multi_latent_attention and interleaved_rope else None
        if ab == "B" and order is not None and tensor.shape[0] == len(order):  # DeepSeek's pairs -> our halves
            tensor = tensor[order]
        (parts.a if ab == "A" else parts.b)[match.group(3)] = tensor.float()
    if not layers:
        raise ValueError(f"{weights} holds no LoRA weights")
    for name, parts in layers.items():
        if parts.a.keys() != parts.b.keys():
            raise ValueError(
                f"{weights}: {name}'s parts {sorted(parts.a.keys() ^ parts.b.keys())} lack lora_A or lora_B"
            )
    widest = max(len(parts.a) for parts in layers.values())
    lora = LoRAConfig(
        dim=rank * widest,
        alpha=lora_alpha * widest,  # alpha / dim = lora_alpha / r, PEFT's scale
        dropout=float(document.get("lora_dropout") or 0.0),
        dropout_position="pre",  # PEFT drops the adapter's input
        target_modules=_our_targets(sorted(layers), config),
    )
    apply_lora(model, lora, ParallelLayout.single(), seed)
    built = dict(adapters(model))
    for name, parts in layers.items():
        a, b = _stacked(name, parts, rank, lora.dim, config, parts_of)
        adapter = built[name]
        for param, value in ((adapter.linear_in.weight, a), (adapter.linear_out.weight, b)):
            if tuple(param.shape) != tuple(value.shape):
                raise ValueError(
                    f"{weights}: the adapter of {name} is {tuple(value.shape)} where the model's is "
                    f"{tuple(param.shape)}; load the adapter onto the base it was trained on"
                )
            with torch.no_grad():
                param.copy_(value.to(param.dtype))
    return lora


def _stacked(
    name: str, parts: _Parts, rank: int, dim: int, config: GPTConfig, parts_of: Parts
) -> tuple[torch.Tensor, torch.Tensor]:
    """Our (A, B) of rank ``dim`` computing the PEFT parts' ``B_p A_p`` each on its own rows."""
    block, names = parts_of[name.split(".", 2)[2]]
    inputs = {a.shape[1] for a in parts.a.values()}
    if len(inputs) != 1:
        raise ValueError(f"the PEFT adapters of {name}'s parts take inputs of different widths {sorted(inputs)}")
    a = torch.zeros(dim, inputs.pop())
    blocks: list[Optional[torch.Tensor]] = []
    slot = 0
    for part in names:
        if part not in parts.a:
            blocks.append(None)
            continue
        a[slot * rank : (slot + 1) * rank] = parts.a[part]
        b = torch.zeros(parts.b[part].shape[0], dim)
        b[:, slot * rank : (slot + 1) * rank] = parts.b[part]
        blocks.append(b)
        slot += 1
    rows = _part_rows(block, names, config)
    full = [b if b is not None else torch.zeros(n, dim) for b, n in zip(blocks, rows)]
    for b, n, part in zip(full, rows, names):
        if b.shape[0] != n:
            raise ValueError(
                f"the PEFT adapter of layer {name.split('.')[1]}'s {part} has {b.shape[0]} output rows where the "
                f"model's {part} has {n}; load the adapter onto the base it was trained on"
            )
    if len(full) == 3:
        return a, _fuse_qkv(full[0], full[1], full[2], config)
    return a, torch.cat(full)


def _part_rows(block: str, names: tuple[str, ...], config: GPTConfig) -> list[int]:
    """Output rows of each HF projection in ``names`` (of HF block ``block``)."""
    if block == "self_attn" and config.multi_latent_attention:
        shapes = attention_shapes("", config)
        return [shapes[f"{n}.weight"][0] for n in names]
    groups, d = config.num_query_groups, config.kv_channels
    assert groups is not None and d is not None and config.ffn_hidden_size is not None  # resolved in __post_init__
    rows = {
        "q_proj": config.num_attention_heads * d,
        "k_proj": groups * d,
        "v_proj": groups * d,
        "o_proj": config.hidden_size,
        "gate_proj": config.ffn_hidden_size,
        "up_proj": config.ffn_hidden_size,
        "down_proj": config.hidden_size,
    }
    return [rows[n] for n in names]


def _our_targets(adapted: list[str], config: GPTConfig) -> list[str]:
    """``target_modules`` selecting exactly our layers ``adapted``: a layer's short name where every layer of that
    name is adapted, else the adapted layers' full names."""
    targets: list[str] = []
    every = adaptable_layer_names(config)
    for short in TARGET_NAMES:
        mine = [n for n in adapted if n.endswith(short)]
        if not mine:
            continue
        if set(mine) == {n for n in every if n.rsplit(".", 1)[-1] == short}:
            targets.append(short)
        else:
            targets += mine
    return targets

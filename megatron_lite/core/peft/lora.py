"""LoRA on a built model: a low-rank adapter beside each chosen tensor-parallel linear, the base frozen.

An adapter adds ``scale * B A x`` to its layer's output (``scale = alpha / dim``) and is sharded the way the layer
is, so that every layout computes the single-process function with no gather of a weight:

- on a **column-parallel** layer (``linear_qkv``, ``linear_fc1``; output split over TP) ``A`` ``[dim, in]`` is
  replicated and ``B`` ``[out, dim]`` split on its output rows exactly as the base weight is (fc1's [gate; up] blocks
  included). ``A x`` is computed on the layer's input as it arrives -- under sequence parallelism this rank's slice
  of the sequence, so ``A``'s gradient is partial over TP like a norm's -- and the small ``[s, b, dim]`` result is
  gathered along the sequence (or, without SP, its gradient all-reduced) before ``B``.
- on a **row-parallel** layer (``linear_proj``, ``linear_fc2``; input split over TP) ``A`` is split on its input
  columns as the base weight is and ``B`` is replicated: the partial ``A x`` are summed over TP (reduce-scattered
  along the sequence under SP, so ``B`` then sees this rank's tokens and its gradient is partial over TP).
- on a **replicated** layer (multi-latent attention's ``linear_q_down_proj``, ``linear_kv_down_proj``: the weight
  whole on every TP rank) ``A`` and ``B`` are whole too and run on the layer's input as it arrives, with no
  collective: their gradients are those of the layer's own weight -- partial over TP under SP (each rank's tokens),
  summed like it; without SP the same on every rank (the up-projections all-reduce their input's gradient).

Only ``[tokens, dim]`` activations cross ranks. The base's parameter names do not change (the adapter is the
layer's ``adapter`` sub-module: ``...linear_qkv.adapter.linear_in.weight`` is ``A``, ``.linear_out.weight`` ``B``,
NeMo's names), so a base checkpoint still loads into an adapted model and the adapters' names do not depend on the
layout. Adapters are drawn from (seed, name) like every parameter: the same at any layout.

An MoE layer's experts (``...mlp.experts.linear_fc1``/``linear_fc2``, one weight per expert) get one adapter per
expert, sharded over expert tensor parallelism: :mod:`megatron_lite.core.peft.expert_lora`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
from typing import Iterator, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.mla import ReplicatedLinear
from megatron_lite.core.models.moe.experts import GroupedLinear
from megatron_lite.core.models.moe_config import moe_layer_pattern
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
)
from megatron_lite.core.parallel.random import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG, RNGStatesTracker
from megatron_lite.core.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    TPShard,
    initialize_parameter,
    mark_parameter,
)
from megatron_lite.core.peft.config import ALL_LINEAR, TARGET_NAMES, LoRAConfig
from megatron_lite.core.peft.expert_lora import ExpertLoRAAdapter, add_expert_rng_streams
from megatron_lite.core.peft.parts import AdapterWeight, a_init_std, adapter_dropout

ADAPTABLE = (ColumnParallelLinear, RowParallelLinear, ReplicatedLinear, GroupedLinear)
"""The layers LoRA adapts: the tensor-parallel linears, MLA's replicated down-projections and the MoE experts'
grouped ones."""

ADAPTER = "adapter"
"""The sub-module name of a layer's adapter (every adapter parameter's name holds ``.adapter.``)."""

LORA_RECIPE = "megatron_lite_lora"
"""The uint8 buffer on an adapted model's root holding its :class:`LoRAConfig` and seed as JSON bytes (the same on
every rank of every layout): every state dict and checkpoint of the model carries how to rebuild its adapters."""


class LoRAAdapter(nn.Module):
    """``scale * B A x`` for one tensor-parallel linear layer (see the module docstring for the sharding).

    Args:
        base: the layer adapted (only its shapes, sharding and group are read; it is not kept).
        config: rank, scale, dropout and ``A``'s initialisation.
        layout: this rank's layout (the TP group and rank).
        rng: the model's dropout streams (with ``config.dropout > 0``).
    """

    def __init__(
        self,
        base: ColumnParallelLinear | RowParallelLinear | ReplicatedLinear,
        config: LoRAConfig,
        layout: ParallelLayout,
        rng: Optional[RNGStatesTracker] = None,
    ) -> None:
        super().__init__()
        self.column = isinstance(base, ColumnParallelLinear)
        self.replicated = isinstance(base, ReplicatedLinear)
        if base.weight is None:
            raise ValueError("LoRA cannot adapt a layer without a weight of its own (a tied output layer)")
        weight_shard: Optional[TPShard] = getattr(base.weight, "tp_shard", None)
        tp, rank = layout.tp_size, layout.tp_rank
        dim, (out_features, in_features) = config.dim, (base.output_size, base.input_size)
        a_std = a_init_std(config, in_features)
        dtype, device = base.weight.dtype, base.weight.device
        if self.replicated:  # both whole, their gradients the layer weight's (partial over TP under SP only)
            a = mark_parameter(
                nn.Parameter(torch.empty(dim, in_features, dtype=dtype, device=device)),
                ("normal", a_std),
                None,
                sequence_parallel_grad=True,
            )
            b = mark_parameter(
                nn.Parameter(torch.empty(out_features, dim, dtype=dtype, device=device)),
                ("zeros",),
                None,
                sequence_parallel_grad=True,
            )
        elif self.column:
            stride = weight_shard.stride if weight_shard is not None else 1
            a = mark_parameter(
                nn.Parameter(torch.empty(dim, in_features, dtype=dtype, device=device)),
                ("normal", a_std),
                None,
                sequence_parallel_grad=True,  # A sees this rank's tokens only under SP
            )
            b = mark_parameter(
                nn.Parameter(torch.empty(out_features // tp, dim, dtype=dtype, device=device)),
                ("zeros",),
                TPShard(0, stride, (out_features, dim), rank, tp),
            )
        else:
            a = mark_parameter(
                nn.Parameter(torch.empty(dim, in_features // tp, dtype=dtype, device=device)),
                ("normal", a_std),
                TPShard(1, 1, (dim, in_features), rank, tp),
            )
            b = mark_parameter(
                nn.Parameter(torch.empty(out_features, dim, dtype=dtype, device=device)),
                ("zeros",),
                None,
                sequence_parallel_grad=True,  # B sees this rank's tokens only under SP
            )
        self.linear_in = AdapterWeight(a)
        self.linear_out = AdapterWeight(b)
        self.scale = config.scale
        self.dropout = config.dropout
        self.dropout_position = config.dropout_position
        self.tp_group = layout.group("tp")
        self.rng = rng
        self.enabled = True
        """False: the layer runs as its base alone (a reference policy, the base's logits)."""

    def forward(self, x: torch.Tensor, sequence_parallel: bool) -> torch.Tensor:
        """The adapter's output for the layer's input ``x``, shaped and sharded as the layer's output."""
        if self.replicated:
            # the input and output are the same on every TP rank without SP (dropped alike there), its tokens under SP
            x = self._dropout(x, replicated=not sequence_parallel) if self.dropout_position == "pre" else x
            out = F.linear(F.linear(x, self.linear_in.weight), self.linear_out.weight) * self.scale
            return self._dropout(out, replicated=not sequence_parallel) if self.dropout_position == "post" else out
        if self.dropout_position == "pre":
            # Replicated over TP only on a column layer's whole-sequence input: there every TP rank drops alike.
            x = self._dropout(x, replicated=self.column and not sequence_parallel)
        h = F.linear(x, self.linear_in.weight)
        if self.column:
            if sequence_parallel:
                h = gather_from_sequence_parallel_region(h, self.tp_group, grad_is_partial=True)
            else:
                h = copy_to_tensor_parallel_region(h, self.tp_group)
        elif sequence_parallel:
            h = reduce_scatter_to_sequence_parallel_region(h, self.tp_group)
        else:
            h = reduce_from_tensor_parallel_region(h, self.tp_group)
        out = F.linear(h, self.linear_out.weight) * self.scale
        if self.dropout_position == "post":
            out = self._dropout(out, replicated=not self.column and not sequence_parallel)
        return out

    def _dropout(self, x: torch.Tensor, replicated: bool) -> torch.Tensor:
        stream = DATA_PARALLEL_RNG if replicated else MODEL_PARALLEL_RNG
        return adapter_dropout(x, self.dropout, self.training, self.rng, stream)

    @torch.no_grad()
    def delta_weight(self) -> torch.Tensor:
        """``scale * B A`` for this rank's shard of the base weight (shaped as it)."""
        return (self.linear_out.weight.float() @ self.linear_in.weight.float()) * self.scale


Adapter = LoRAAdapter | ExpertLoRAAdapter
"""An adapter of either kind: on a tensor-parallel linear, or on an MoE layer's experts."""


def adaptable_layers(model: nn.Module) -> Iterator[tuple[str, nn.Module]]:
    """(full name, layer) of every linear layer of ``model`` LoRA can adapt (by :data:`TARGET_NAMES` name)."""
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in TARGET_NAMES and isinstance(module, ADAPTABLE):
            yield name, module


def adaptable_layer_names(config: GPTConfig) -> list[str]:
    """The full names of every linear layer of a model of ``config`` (all pipeline stages) LoRA can adapt, without
    building it: what a configuration's ``target_modules`` are checked against before launch."""
    pattern = moe_layer_pattern(config) if config.num_moe_experts is not None else [False] * config.num_layers
    names = []
    for index, is_moe in enumerate(pattern):
        layer = f"layers.{index}"
        names += [f"{layer}.self_attention.{linear}" for linear in attention_linears(config)]
        mlps = [f"{layer}.mlp"] if not is_moe else [f"{layer}.mlp.experts"]
        if is_moe and config.moe_shared_expert_intermediate_size is not None:
            mlps.append(f"{layer}.mlp.shared_experts")
        names += [f"{mlp}.{fc}" for mlp in mlps for fc in ("linear_fc1", "linear_fc2")]
    return names


def attention_linears(config: GPTConfig) -> list[str]:
    """The names of the linear layers of a self-attention of ``config`` (MLA's projections, or the fused QKV's)."""
    if not config.multi_latent_attention:
        return ["linear_qkv", "linear_proj"]
    queries = ["linear_q_proj"] if config.q_lora_rank is None else ["linear_q_down_proj", "linear_q_up_proj"]
    return [*queries, "linear_kv_down_proj", "linear_kv_up_proj", "linear_proj"]


def check_targets(config: LoRAConfig, model_config: GPTConfig) -> list[str]:
    """The layers of a model of ``model_config`` that ``config`` adapts; refuses targets that select none."""
    names = adaptable_layer_names(model_config)
    for target in config.target_modules:
        if not any(LoRAConfig(target_modules=[target]).selects(name) for name in names):
            raise ValueError(
                f"LoRA target_modules: {target!r} selects none of this model's linear layers (e.g. "
                f"{', '.join(names[:4])}): name one of {_present(names)} or a pattern matching full names"
            )
    return [name for name in names if config.selects(name)]


def _present(names: list[str]) -> list[str]:
    """``"all-linear"`` and the layer names (of :data:`TARGET_NAMES`, in its order) that ``names`` hold."""
    shorts = {name.rsplit(".", 1)[-1] for name in names}
    return [ALL_LINEAR, *(short for short in TARGET_NAMES if short in shorts)]


def apply_lora(model: nn.Module, config: LoRAConfig, layout: ParallelLayout, seed: int) -> list[str]:
    """Add an adapter to every layer of ``model`` that ``config.target_modules`` selects, draw the adapters from
    (``seed``, name), and freeze everything else. Returns the adapted layers' names (this rank's). Idempotent: a
    model that has adapters already is left as it is."""
    names = []
    rng = getattr(model, "rng_tracker", None)
    for name, layer in adaptable_layers(model):
        if not config.selects(name):
            continue
        names.append(name)
        if layer.adapter is not None:
            continue
        if isinstance(layer, GroupedLinear):
            if rng is not None and config.dropout > 0:
                add_expert_rng_streams(rng, layout)
            layer.adapter = ExpertLoRAAdapter(layer, config, layout, rng)
        else:
            layer.adapter = LoRAAdapter(layer, config, layout, rng)
        for param_name, param in layer.adapter.named_parameters():
            initialize_parameter(f"{name}.{ADAPTER}.{param_name}", param, seed)
    for param_name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(param_name))
    model.register_buffer(LORA_RECIPE, _recipe_tensor(config, seed))
    return names


def _recipe_tensor(config: LoRAConfig, seed: int) -> torch.Tensor:
    text = json.dumps({"format": 1, "config": dataclasses.asdict(config), "seed": seed}, sort_keys=True)
    return torch.tensor(list(text.encode()), dtype=torch.uint8)


def read_recipe(tensor: torch.Tensor) -> tuple[LoRAConfig, int]:
    """(config, seed) from a :data:`LORA_RECIPE` tensor (a model's buffer or a checkpoint's entry)."""
    try:
        recipe = json.loads(bytes(tensor.detach().cpu().to(torch.uint8).tolist()).decode())
        return LoRAConfig(**recipe["config"]), int(recipe["seed"])
    except (ValueError, KeyError, TypeError) as error:
        raise ValueError(f"the {LORA_RECIPE} entry is not a LoRA recipe: {error}") from None


def lora_recipe(model: Optional[nn.Module]) -> Optional[tuple[LoRAConfig, int]]:
    """(config, seed) of ``model``'s adapters, or None when it has none."""
    buf = getattr(model, LORA_RECIPE, None) if model is not None else None
    return read_recipe(buf) if isinstance(buf, torch.Tensor) else None


def restore_lora(model: nn.Module, state: dict, layout: ParallelLayout, prefix: str = "") -> bool:
    """Give ``model`` the adapters a state dict (``state``, keys ``prefix + name``) holds, if it holds a LoRA recipe
    and ``model`` has none yet; their values are the caller's to load. Returns whether adapters were added."""
    recipe = state.get(f"{prefix}{LORA_RECIPE}")
    if recipe is None or lora_recipe(model) is not None:
        return False
    config, seed = read_recipe(recipe)
    apply_lora(model, config, layout, seed)
    return True


def carry_adapters(previous: Optional[nn.Module], model: nn.Module, layout: ParallelLayout) -> None:
    """Give ``model`` (built anew for ``layout``) the adapters ``previous`` has, so that carrying the weights over
    keeps them (a validate or generate after a LoRA fit, at another layout)."""
    recipe = lora_recipe(previous)
    if recipe is not None and lora_recipe(model) is None:
        apply_lora(model, recipe[0], layout, recipe[1])


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter (or buffer) named ``name`` belongs to a LoRA adapter."""
    return f".{ADAPTER}." in f".{name}"


def adapters(model: nn.Module) -> Iterator[tuple[str, Adapter]]:
    """(layer name, adapter) of every adapted layer of ``model`` (the experts' included)."""
    for name, module in model.named_modules():
        if isinstance(module, (LoRAAdapter, ExpertLoRAAdapter)):
            yield name.rsplit(".", 1)[0], module


def has_adapters(model: Optional[nn.Module]) -> bool:
    """Whether ``model`` carries LoRA adapters."""
    return model is not None and any(True for _ in adapters(model))


@contextlib.contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """Run ``model`` as its base: every adapter adds nothing inside the block (the frozen reference of DPO and
    GRPO with LoRA is the policy itself with its adapters off: no second model in memory)."""
    switched = [adapter for _, adapter in adapters(model) if adapter.enabled]
    for adapter in switched:
        adapter.enabled = False
    try:
        yield
    finally:
        for adapter in switched:
            adapter.enabled = True


@torch.no_grad()
def merge_lora(model: nn.Module) -> list[str]:
    """Fold every adapter into its layer's weight (``W += scale * B A``, shard by shard; an MoE layer's experts'
    ``W_e += scale * B_e A_e`` each) and remove it: ``model`` is a plain model computing what the adapted one did.
    Returns the merged layers' names."""
    merged = []
    for name, module in list(model.named_modules()):
        adapter = getattr(module, ADAPTER, None)
        if isinstance(adapter, (LoRAAdapter, ExpertLoRAAdapter)):
            weight = module.weight
            weight.add_(adapter.delta_weight().to(weight.dtype))
            module.adapter = None
            merged.append(name)
    if hasattr(model, LORA_RECIPE):
        delattr(model, LORA_RECIPE)
    return merged

"""Minitron-style structured pruning of a trained GPT: depth (whole layers) and width (query groups, heads per
group, FFN neurons, hidden channels), ranked by activation statistics on a few calibration batches.

Importance (Sreenivas et al. 2024, "LLM Pruning and Distillation in Practice: The Minitron Approach"; Muralidharan
et al. 2024, "Compact Language Models via Pruning and Knowledge Distillation"), all means over calibration tokens:

- a layer: ``1 - cos(input, output)`` of the block ("cosine", Block Influence: a block that barely turns the
  residual stream does little), or the LM-loss increase when the block is skipped ("loss": one extra forward per
  layer, the most direct measure);
- an attention head: the L2 norm of its output (the attention result before the output projection); a query
  group: the sum of its heads';
- an FFN neuron: ``|act(x W_gate) * x W_up|`` (the input of fc2);
- a hidden channel: ``|norm(x)|`` summed over every norm layer's output (what each channel feeds the blocks).

Each layer keeps its own most important groups/heads/neurons (their number is the same in every layer: the config
is uniform); every layer keeps the same hidden channels (the residual stream is shared). Importance is estimated
once on the unpruned model, then all axes are cut together. RMSNorm/LayerNorm over fewer channels normalise by
the kept channels only, so width pruning changes the function beyond the removed parts: distillation from the
unpruned model (``megatron_lite.callbacks.Distill``) recovers it.

Statistics are taken on one process: :func:`prune` takes a module whose model is built for one process
(``GPTModule.from_pretrained(ckpt)`` builds one), so under tensor parallelism there are no per-shard statistics to
gather. The pruned module is an ordinary :class:`~megatron_lite.GPTModule`; ``megatron_lite.pretrained
.save_weights_checkpoint`` writes it as one of our checkpoints (``megatron-lite prune`` does both).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Iterable, Literal, Optional

import torch
import torch.nn.functional as F

from megatron_lite.core.models.config import GPTConfig, refuse_mla
from megatron_lite.core.models.gpt import GPTModel
from megatron_lite.core.models.moe_config import refuse_experts
from megatron_lite.core.parallel.layout import ParallelLayout

LAYER_METRICS = ("cosine", "loss")


@dataclass
class PruneTarget:
    """The pruned model's shape; a field left None keeps the original size."""

    num_layers: Optional[int] = None
    """Transformer layers to keep (depth pruning: the least important ones are dropped)."""
    hidden_size: Optional[int] = None
    """Residual-stream width to keep (embedding channels)."""
    num_attention_heads: Optional[int] = None
    """Query heads to keep; a multiple of the kept query groups (an MHA model stays MHA if groups are not given)."""
    num_query_groups: Optional[int] = None
    """Key/value heads (query groups) to keep; each keeps its queries unless num_attention_heads says fewer."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width to keep (neurons)."""

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(
                    f"PruneTarget({f.name}={value!r}): {f.name} must be a positive integer or None (keep the model's)"
                )
        if all(getattr(self, f.name) is None for f in dataclasses.fields(self)):
            raise ValueError(
                "PruneTarget() prunes nothing: set at least one of num_layers, hidden_size, "
                "num_attention_heads, num_query_groups, ffn_hidden_size"
            )

    def pruned_config(self, config: GPTConfig) -> GPTConfig:
        """``config`` cut to this target; a ValueError naming the fix when the target cannot be reached."""
        for name in ("num_layers", "hidden_size", "num_attention_heads", "num_query_groups", "ffn_hidden_size"):
            value, size = getattr(self, name), getattr(config, name)
            if value is not None and value > size:
                raise ValueError(
                    f"PruneTarget({name}={value}) is larger than the model's {name} ({size}); pruning "
                    f"only removes: choose {name} <= {size}"
                )
        heads, groups = self.num_attention_heads, self.num_query_groups
        mha = config.num_query_groups == config.num_attention_heads
        if groups is None:
            # MHA stays MHA; under GQA the groups stay and each loses the same number of queries.
            groups = heads if (mha and heads is not None) else config.num_query_groups
        if heads is None:
            heads = groups * (config.num_attention_heads // config.num_query_groups)
        if heads % groups:
            raise ValueError(
                f"PruneTarget: num_attention_heads ({heads}) must be a multiple of num_query_groups "
                f"({groups}); every query group keeps the same number of heads"
            )
        if heads // groups > config.num_attention_heads // config.num_query_groups:
            raise ValueError(
                f"PruneTarget: {heads} heads in {groups} query groups is {heads // groups} per group, more "
                f"than the model's {config.num_attention_heads // config.num_query_groups}; keep more "
                f"groups or fewer heads"
            )
        layers = self.num_layers or config.num_layers
        recompute = {}
        if config.recompute_num_layers is not None and config.recompute_num_layers > layers:
            recompute["recompute_num_layers"] = layers  # otherwise the pruned config would refuse itself
        # kv_channels is kept explicitly: a head's width (and RoPE's rotation) does not change with the count.
        return dataclasses.replace(
            config,
            num_layers=layers,
            hidden_size=self.hidden_size or config.hidden_size,
            num_attention_heads=heads,
            num_query_groups=groups,
            ffn_hidden_size=self.ffn_hidden_size or config.ffn_hidden_size,
            kv_channels=config.kv_channels,
            **recompute,
        )


@dataclass
class Importance:
    """Importance scores of one model from calibration data (higher: more important)."""

    layers: torch.Tensor
    """[num_layers]: 1 - cos(block input, block output), or the LM-loss increase when the block is skipped."""
    heads: torch.Tensor
    """[num_layers, num_attention_heads]: mean L2 norm of each head's attention output."""
    neurons: torch.Tensor
    """[num_layers, ffn_hidden_size]: mean |activation| at each MLP neuron (fc2's input)."""
    channels: torch.Tensor
    """[hidden_size]: mean |output| of each channel, summed over every norm layer."""
    layer_metric: str
    """Which layer score ``layers`` holds ('cosine' or 'loss')."""
    base_loss: float
    """Mean LM loss of the unpruned model on the calibration tokens."""


@dataclass
class PrunePlan:
    """Which parts of the model are kept (indices of the unpruned model, ascending)."""

    config: GPTConfig
    """The pruned model's config."""
    layers: list[int]
    """Kept layers, in order (layer i of the pruned model is layers[i])."""
    channels: list[int]
    """Kept hidden channels."""
    groups: list[list[int]]
    """Per kept layer: kept query groups."""
    heads: list[list[list[int]]]
    """Per kept layer and kept group: kept query heads, as positions inside the group."""
    neurons: list[list[int]]
    """Per kept layer: kept FFN neurons."""


def _single_process_model(module: Any) -> GPTModel:
    model = getattr(module, "model", None)
    if not isinstance(model, GPTModel):
        raise ValueError(
            "prune needs a GPTModule holding a built GPTModel; load one with GPTModule.from_pretrained(checkpoint)"
        )
    if model.layout.world_size != 1:
        raise ValueError(
            f"pruning statistics are taken on one process, but this model is built for "
            f"{model.layout.world_size} (tp={model.layout.tp_size}, pp={model.layout.pp_size}); load the "
            f"checkpoint with GPTModule.from_pretrained(path), which builds a one-process model"
        )
    if not model.has_output_layer:
        raise ValueError("prune needs a language model with its output layer (the LM loss ranks layers)")
    refuse_experts(model.config, "pruning")  # its width statistics know the dense MLP's neurons only
    refuse_mla(model.config, "pruning")
    return model


def _calibration_tokens(batches: Iterable[Any], seq_limit: int) -> list[torch.Tensor]:
    """Each batch as tokens [b, s+1] (a dict with "tokens", or a tensor)."""
    out = []
    for batch in batches:
        tokens = batch["tokens"] if isinstance(batch, dict) else batch
        if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2 or tokens.shape[1] < 2:
            raise ValueError(
                "calibration batches are {'tokens': LongTensor[b, s+1]} (or such tensors), as the "
                "datamodules' train batches are"
            )
        if tokens.shape[1] - 1 > seq_limit:
            raise ValueError(
                f"calibration rows of {tokens.shape[1] - 1} tokens are longer than the model's "
                f"max_position_embeddings ({seq_limit}); cut them to seq_length + 1 tokens"
            )
        out.append(tokens.long())
    if not out:
        raise ValueError("prune needs at least one calibration batch; pass e.g. a few of the training batches")
    return out


def _mean_loss(model: GPTModel, batches: list[torch.Tensor]) -> float:
    total, count = 0.0, 0
    for tokens in batches:
        loss = model(tokens[:, :-1], tokens[:, 1:])
        total, count = total + float(loss.double().sum()), count + loss.numel()
    return total / count


@torch.no_grad()
def estimate_importance(
    module: Any, calib_batches: Iterable[Any], layer_metric: Literal["cosine", "loss"] = "cosine"
) -> Importance:
    """Importance of every layer, head, neuron and hidden channel of ``module``'s one-process model, from
    forward hooks over ``calib_batches`` (``{"tokens": [b, s+1]}`` dicts or tensors)."""
    if layer_metric not in LAYER_METRICS:
        raise ValueError(f"layer_metric must be one of {LAYER_METRICS}, got {layer_metric!r}")
    model = _single_process_model(module)
    config: GPTConfig = model.config
    batches = _calibration_tokens(
        calib_batches,
        config.max_position_embeddings if config.position_embedding_type == "learned_absolute" else 1 << 62,
    )
    L, H, d = config.num_layers, config.num_attention_heads, config.kv_channels
    sums = {
        "layers": torch.zeros(L, dtype=torch.float64),
        "heads": torch.zeros(L, H, dtype=torch.float64),
        "neurons": torch.zeros(L, config.ffn_hidden_size, dtype=torch.float64),
        "channels": torch.zeros(config.hidden_size, dtype=torch.float64),
    }

    def block(i):
        def hook(_, args, output):
            cos = F.cosine_similarity(args[0].double(), output.double(), dim=-1)
            sums["layers"][i] += (1.0 - cos).sum()

        return hook

    def heads(i):
        def hook(_, args):  # the projection's input: [s, b, heads * d]
            x = args[0].double()
            sums["heads"][i] += x.reshape(*x.shape[:-1], H, d).norm(dim=-1).sum(dim=(0, 1))

        return hook

    def neurons(i):
        def hook(_, args):
            sums["neurons"][i] += args[0].double().abs().sum(dim=(0, 1))

        return hook

    def channels(_, args, output):
        sums["channels"].add_(output.double().abs().sum(dim=(0, 1)))

    handles = []
    was_training = model.training
    model.eval()
    try:
        for key, layer in model.layers.items():
            i = int(key)
            if layer_metric == "cosine":
                handles.append(layer.register_forward_hook(block(i)))
            handles.append(layer.self_attention.linear_proj.register_forward_pre_hook(heads(i)))
            handles.append(layer.mlp.linear_fc2.register_forward_pre_hook(neurons(i)))
            for norm in (layer.input_layernorm, layer.pre_mlp_layernorm):
                handles.append(norm.register_forward_hook(channels))
        handles.append(model.final_layernorm.register_forward_hook(channels))
        base_loss = _mean_loss(model, batches)  # the hooks accumulate during these forwards
        for handle in handles:
            handle.remove()
        handles = []
        n = sum(tokens[:, :-1].numel() for tokens in batches)
        layer_scores = sums["layers"] / n
        if layer_metric == "loss":  # one forward per layer with that block skipped (its output = its input)
            scores = []
            for key in sorted(model.layers, key=int):
                handle = model.layers[key].register_forward_hook(lambda _, args, output: args[0])
                try:
                    scores.append(_mean_loss(model, batches) - base_loss)
                finally:
                    handle.remove()
            layer_scores = torch.tensor(scores, dtype=torch.float64)
    finally:
        for handle in handles:
            handle.remove()
        model.train(was_training)
    return Importance(
        layers=layer_scores.float(),
        heads=(sums["heads"] / n).float(),
        neurons=(sums["neurons"] / n).float(),
        channels=(sums["channels"] / n).float(),
        layer_metric=layer_metric,
        base_loss=base_loss,
    )


def _top(scores: torch.Tensor, k: int) -> list[int]:
    """Indices of the k highest scores, ascending (ties: the earlier index, so plans are deterministic)."""
    order = sorted(range(scores.numel()), key=lambda i: (-float(scores[i]), i))
    return sorted(order[:k])


def plan_pruning(config: GPTConfig, importance: Importance, target: PruneTarget) -> PrunePlan:
    """What to keep of a model of ``config`` to reach ``target``, by ``importance``."""
    new = target.pruned_config(config)
    groups_old, q_old = config.num_query_groups, config.num_attention_heads // config.num_query_groups
    q_new = new.num_attention_heads // new.num_query_groups
    layers = _top(importance.layers, new.num_layers)
    groups, heads, neurons = [], [], []
    for layer in layers:
        per_head = importance.heads[layer].reshape(groups_old, q_old)
        kept_groups = _top(per_head.sum(dim=1), new.num_query_groups)
        groups.append(kept_groups)
        heads.append([_top(per_head[g], q_new) for g in kept_groups])
        neurons.append(_top(importance.neurons[layer], new.ffn_hidden_size))
    return PrunePlan(
        config=new,
        layers=layers,
        channels=_top(importance.channels, new.hidden_size),
        groups=groups,
        heads=heads,
        neurons=neurons,
    )


def _sliced_state(model: GPTModel, plan: PrunePlan) -> dict[str, torch.Tensor]:
    """The kept weights of ``model`` keyed like the pruned model's parameters."""
    old = model.config
    ch = torch.tensor(plan.channels)
    d, q_old = old.kv_channels, old.num_attention_heads // old.num_query_groups
    state = {name: p.detach() for name, p in model.named_parameters()}
    out: dict[str, torch.Tensor] = {}
    for name in ("embedding.weight", "output_layer.weight", "position_embeddings.weight"):
        if name in state:
            out[name] = state[name][:, ch]
    for name in ("final_layernorm.weight", "final_layernorm.bias"):
        if name in state:
            out[name] = state[name][ch]
    for i, layer in enumerate(plan.layers):
        src, dst = f"layers.{layer}.", f"layers.{i}."
        # QKV rows are [groups, (queries of the group, key, value), d]: keep groups, then queries, key and value.
        rows = torch.tensor(
            [g * (q_old + 2) + j for g, qs in zip(plan.groups[i], plan.heads[i]) for j in (*qs, q_old, q_old + 1)]
        )
        rows = (rows[:, None] * d + torch.arange(d)).reshape(-1)
        heads = torch.tensor([g * q_old + j for g, qs in zip(plan.groups[i], plan.heads[i]) for j in qs])
        cols = (heads[:, None] * d + torch.arange(d)).reshape(-1)  # linear_proj's input: [heads, d]
        neurons = torch.tensor(plan.neurons[i])
        if old.activation == "swiglu":  # fc1 holds [gate; up]
            neurons_fc1 = torch.cat([neurons, neurons + old.ffn_hidden_size])
        else:
            neurons_fc1 = neurons
        cuts = {
            "input_layernorm.weight": (ch,),
            "input_layernorm.bias": (ch,),
            "pre_mlp_layernorm.weight": (ch,),
            "pre_mlp_layernorm.bias": (ch,),
            "self_attention.linear_qkv.weight": (rows, ch),
            "self_attention.linear_qkv.bias": (rows,),
            "self_attention.linear_proj.weight": (ch, cols),
            "self_attention.linear_proj.bias": (ch,),
            # qk_layernorm: one weight over a head's width, shared by every head (the width is kept)
            "self_attention.q_layernorm.weight": (slice(None),),
            "self_attention.q_layernorm.bias": (slice(None),),
            "self_attention.k_layernorm.weight": (slice(None),),
            "self_attention.k_layernorm.bias": (slice(None),),
            "mlp.linear_fc1.weight": (neurons_fc1, ch),
            "mlp.linear_fc1.bias": (neurons_fc1,),
            "mlp.linear_fc2.weight": (ch, neurons),
            "mlp.linear_fc2.bias": (ch,),
        }
        for suffix, index in cuts.items():
            if src + suffix in state:
                tensor = state[src + suffix][index[0]]
                out[dst + suffix] = tensor[:, index[1]] if len(index) == 2 else tensor
    return out


def apply_plan(module: Any, plan: PrunePlan) -> Any:
    """A new module of ``module``'s class holding the kept weights, its one-process model in eval mode."""
    model = _single_process_model(module)
    state = _sliced_state(model, plan)
    pruned = type(module)(plan.config, module.optimizer_config, module.seed)
    pruned.model = pruned.build_model(ParallelLayout.single())
    params = dict(pruned.model.named_parameters())
    if set(params) != set(state):
        raise RuntimeError(
            f"pruned weights {sorted(set(state) ^ set(params))} do not match the pruned model: a "
            f"parameter this pruner does not know"
        )
    with torch.no_grad():
        for name, param in params.items():
            if param.shape != state[name].shape:
                raise RuntimeError(f"{name}: sliced {tuple(state[name].shape)}, pruned model has {tuple(param.shape)}")
            param.copy_(state[name])
    pruned.model.eval()
    return pruned


def prune(
    module: Any, target: PruneTarget, calib_batches: Iterable[Any], layer_metric: Literal["cosine", "loss"] = "cosine"
) -> Any:
    """``module`` (a GPTModule with a one-process model, e.g. from ``GPTModule.from_pretrained``) pruned to
    ``target`` by importance on ``calib_batches``: a new module of the same class with the smaller config."""
    if not isinstance(target, PruneTarget):
        raise TypeError(f"target must be a PruneTarget, got {type(target).__name__}")
    model = _single_process_model(module)
    target.pruned_config(model.config)  # refuse an impossible target before any forward
    importance = estimate_importance(module, calib_batches, layer_metric)
    return apply_plan(module, plan_pruning(model.config, importance, target))

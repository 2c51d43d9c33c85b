"""HF Llama tensors <-> our full state dict (global tensors keyed by :class:`GPTModel`'s parameter names).

The layouts that differ:
- attention: HF keeps ``q_proj`` [heads*d, h], ``k_proj`` and ``v_proj`` [groups*d, h]; our ``linear_qkv`` fuses
  them in Megatron's grouped order ``[groups, (heads_per_group + 2), d]`` along the output dim (each query
  group's query heads, then its key, then its value), so a contiguous TP slice holds whole groups;
- MLP: our ``linear_fc1`` is ``[gate; up]`` (``gate_proj`` rows, then ``up_proj`` rows); TP splits each half
  separately (``stride=2``);
- vocabulary: HF holds exactly ``vocab_size`` rows; a model of ours may hold padded rows
  (:func:`fit_vocab_rows` is the one place that bridges the two).
RoPE needs no permutation: HF's Llama rotates non-interleaved halves of each head, as we do. Qwen3's per-head
``q_norm``/``k_norm`` [d] are our ``q_layernorm``/``k_layernorm`` as they are.

MoE layers (:class:`_MoENames`): the router ``gate`` [E, h] is our ``mlp.router.weight``; our experts' global
``linear_fc1`` [E, 2f, h] holds each expert's [gate; up] as the dense MLP does, ``linear_fc2`` [E, h, f]. Hub
checkpoints (what ``save_pretrained`` writes) keep one tensor per expert -- Mixtral's ``block_sparse_moe.experts.{j}``
``w1`` (gate), ``w3`` (up), ``w2`` (down), Qwen's ``mlp.experts.{j}`` ``gate_proj``/``up_proj``/``down_proj`` -- and
are what an export writes; transformers 5's own layout (``save_original_format=False``), ``mlp.experts.gate_up_proj``
[E, 2f, h] and ``down_proj`` [E, h, f] under ``mlp.`` for all three, is read too. Qwen2-MoE's ``shared_expert`` is a
dense MLP (our ``shared_experts``) and its ``shared_expert_gate`` [1, h] our ``shared_experts.gate_weight``.
"""

from __future__ import annotations

import dataclasses
from typing import Mapping

import torch

from megatron_lite.core.checkpoint.hf import deepseek
from megatron_lite.core.checkpoint.hf.moe import moe_model_type
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe_config import moe_layer_pattern

# Buffers some old HF checkpoints saved; they are recomputed from the config, never read.
_IGNORED_SUFFIXES = (".rotary_emb.inv_freq",)
# Qwen3's per-head query and key norms (HF name, ours under self_attention).
_QK_NORMS = (("q_norm", "q_layernorm"), ("k_norm", "k_layernorm"))
# The tensor that marks transformers 5's fused expert layout.
_FUSED_MARK = ".mlp.experts.gate_up_proj"


@dataclasses.dataclass(frozen=True)
class _MoENames:
    """The HF names of one MoE layer's tensors (``p``: its prefix ``model.layers.{i}.``)."""

    p: str
    mixtral: bool
    fused: bool
    deepseek: bool = False

    @property
    def block(self) -> str:
        return self.p + ("block_sparse_moe." if self.mixtral and not self.fused else "mlp.")

    @property
    def router(self) -> str:
        return self.block + "gate.weight"

    @property
    def gate_up(self) -> str:
        return self.block + "experts.gate_up_proj"

    @property
    def down(self) -> str:
        return self.block + "experts.down_proj"

    def expert(self, j: int) -> tuple[str, str, str]:
        """Expert ``j``'s (gate, up, down) weights, one tensor each."""
        e = f"{self.block}experts.{j}."
        if self.mixtral:
            return e + "w1.weight", e + "w3.weight", e + "w2.weight"
        return e + "gate_proj.weight", e + "up_proj.weight", e + "down_proj.weight"

    @property
    def shared(self) -> str:
        return self.block + ("shared_experts." if self.deepseek else "shared_expert.")

    @property
    def expert_bias(self) -> str:
        """DeepSeek's ``e_score_correction_bias`` (our router's ``expert_bias``)."""
        return self.block + "gate.e_score_correction_bias"

    @property
    def shared_gate(self) -> str:
        return self.block + "shared_expert_gate.weight"


def is_fused_expert_layout(names) -> bool:
    """Whether HF tensor ``names`` hold experts in transformers 5's fused layout (not one tensor per expert)."""
    return any(name.endswith(_FUSED_MARK) for name in names)


def _moe_names(config: GPTConfig, fused: bool) -> list[_MoENames | None]:
    """Per layer, the HF names of its MoE tensors (None for a dense layer)."""
    mla = config.multi_latent_attention  # an MLA model is a DeepSeek-V3
    mixtral = config.num_moe_experts is not None and not mla and moe_model_type(config) == "mixtral"
    return [
        _MoENames(f"model.layers.{i}.", mixtral, fused, mla) if is_moe else None
        for i, is_moe in enumerate(moe_layer_pattern(config))
    ]


def _moe_shapes(names: _MoENames, config: GPTConfig) -> dict[str, tuple[int, ...]]:
    e, h, f = config.num_moe_experts, config.hidden_size, config.moe_ffn_hidden_size
    assert e is not None and f is not None  # an MoE config, resolved by GPTConfig.__post_init__
    shapes: dict[str, tuple[int, ...]] = {names.router: (e, h)}
    if names.deepseek:
        shapes[names.expert_bias] = (e,)
    if names.fused:
        shapes.update({names.gate_up: (e, 2 * f, h), names.down: (e, h, f)})
    else:
        for j in range(e):
            gate, up, down = names.expert(j)
            shapes.update({gate: (f, h), up: (f, h), down: (h, f)})
    width = config.moe_shared_expert_intermediate_size
    if width is not None:
        s = names.shared
        shapes.update(
            {s + "gate_proj.weight": (width, h), s + "up_proj.weight": (width, h), s + "down_proj.weight": (h, width)}
        )
        if config.moe_shared_expert_gate:
            shapes[names.shared_gate] = (1, h)
    return shapes


def fit_vocab_rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """``tensor`` with exactly ``rows`` rows: the first ``rows`` when it has more (dropping vocabulary
    padding), zero rows appended when it has fewer (padding a model that wants padded rows)."""
    if tensor.shape[0] == rows:
        return tensor
    if tensor.shape[0] > rows:
        return tensor[:rows]
    pad = torch.zeros((rows - tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype)
    return torch.cat([tensor, pad], dim=0)


def _layer_names(i: int, config: GPTConfig, moe: _MoENames | None) -> dict[str, tuple[int, ...]]:
    """HF names and shapes of layer ``i`` (``moe``: its MoE names, None for a dense MLP)."""
    groups, _, d = _query_groups(config)
    h, f = config.hidden_size, config.ffn_hidden_size
    assert f is not None  # resolved by GPTConfig.__post_init__
    q, kv = config.num_attention_heads * d, groups * d
    p = f"model.layers.{i}."
    shapes: dict[str, tuple[int, ...]] = {
        p + "input_layernorm.weight": (h,),
        p + "post_attention_layernorm.weight": (h,),
    }
    if config.multi_latent_attention:
        shapes.update(deepseek.attention_shapes(p + "self_attn.", config))
    else:
        shapes.update(
            {
                p + "self_attn.q_proj.weight": (q, h),
                p + "self_attn.k_proj.weight": (kv, h),
                p + "self_attn.v_proj.weight": (kv, h),
                p + "self_attn.o_proj.weight": (h, q),
            }
        )
    if moe is not None:
        shapes.update(_moe_shapes(moe, config))
    else:
        shapes.update(
            {p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h), p + "mlp.down_proj.weight": (h, f)}
        )
    if config.qk_layernorm:
        shapes.update({p + "self_attn.q_norm.weight": (d,), p + "self_attn.k_norm.weight": (d,)})
    if config.add_bias_linear or config.add_qkv_bias:
        shapes.update(
            {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,), p + "self_attn.v_proj.bias": (kv,)}
        )
    if config.add_bias_linear:
        shapes.update(
            {
                p + "self_attn.o_proj.bias": (h,),
                p + "mlp.gate_proj.bias": (f,),
                p + "mlp.up_proj.bias": (f,),
                p + "mlp.down_proj.bias": (h,),
            }
        )
    return shapes


def hf_shapes(config: GPTConfig, fused_experts: bool = False) -> dict[str, tuple[int, ...]]:
    """Every tensor an HF checkpoint of ``config`` holds, with its shape (``lm_head`` only when untied; experts one
    tensor each, or in transformers 5's fused layout)."""
    h, v = config.hidden_size, config.vocab_size
    shapes = {"model.embed_tokens.weight": (v, h), "model.norm.weight": (h,)}
    for i, moe in enumerate(_moe_names(config, fused_experts)):
        shapes.update(_layer_names(i, config, moe))
    for i, moe in _mtp_layers(config, fused_experts):
        shapes.update(_layer_names(i, config, moe))
        p = f"model.layers.{i}."
        shapes.update({p + name: (h,) for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight")})
        shapes.update({p + "eh_proj.weight": (h, 2 * h)})
        shapes.update({p + name: (v, h) for name in _MTP_SHARED_COPIES})
    if not config.share_embeddings_and_output_weights:
        shapes["lm_head.weight"] = (v, h)
    return shapes


# DeepSeek-V3's MTP layer (``model.layers.{num_hidden_layers + k}``): its norms and projection (ours under
# ``mtp.layers.{i}.``); its transformer layer is a decoder layer's tensors (ours under ``...transformer_layer.``).
_MTP_NAMES = (("enorm", "enorm"), ("hnorm", "hnorm"), ("eh_proj", "eh_proj"), ("shared_head.norm", "final_layernorm"))
# Copies of the embedding and the output layer DeepSeek's checkpoints keep in each MTP layer (the model shares them):
# written on export for the engines that read them, optional on import.
_MTP_SHARED_COPIES = ("embed_tokens.weight", "shared_head.head.weight")


def _mtp_layers(config: GPTConfig, fused: bool) -> list[tuple[int, _MoENames | None]]:
    """(global layer number, MoE names or None) of each MTP depth: a DeepSeek-V3 MTP layer is of its last layer's
    kind."""
    last = _moe_names(config, fused)[-1]
    return [
        (i, dataclasses.replace(last, p=f"model.layers.{i}.") if last is not None else None)
        for i in range(config.num_layers, config.num_layers + (config.mtp_num_layers or 0))
    ]


def check_hf_shapes(saved: Mapping[str, tuple[int, ...]], config: GPTConfig) -> None:
    """Raise a ValueError naming every tensor whose saved shape is not the one ``config`` expects, and every
    missing or unexpected tensor. A tied model may carry a copy of the embedding as ``lm_head.weight``."""
    expected = hf_shapes(config, is_fused_expert_layout(saved))
    saved = {k: tuple(v) for k, v in saved.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.share_embeddings_and_output_weights:
        saved.pop("lm_head.weight", None)
    for name in [name for name in expected if name.endswith(_MTP_SHARED_COPIES) and name not in saved]:
        del expected[name]  # optional: the model's own embedding and output layer
    raise_shape_mismatch(saved, expected, "the HF checkpoint", "its config")


def raise_shape_mismatch(
    saved: Mapping[str, tuple[int, ...]],
    expected: Mapping[str, tuple[int, ...]],
    source: str,
    target: str,
    vocab_size: int | None = None,
) -> None:
    """Raise one ValueError listing every parameter whose ``saved`` shape differs from the ``expected`` one
    (saved vs expected), and the missing and unexpected names. With ``vocab_size``, a difference in
    vocabulary padding alone (one dimension, both sizes >= vocab_size) is not a difference."""

    def differs(a: tuple[int, ...], b: tuple[int, ...]) -> bool:
        if a == b:
            return False
        diff = [i for i, (x, y) in enumerate(zip(a, b)) if x != y]
        return not (
            vocab_size is not None and len(a) == len(b) and len(diff) == 1 and min(a[diff[0]], b[diff[0]]) >= vocab_size
        )

    wrong = [
        f"{name}: saved {tuple(saved[name])}, expected {tuple(shape)}"
        for name, shape in expected.items()
        if name in saved and differs(tuple(saved[name]), tuple(shape))
    ]
    missing = [name for name in expected if name not in saved]
    unexpected = [name for name in saved if name not in expected]
    if not (wrong or missing or unexpected):
        return
    parts = []
    if wrong:
        parts.append(
            f"{len(wrong)} parameter(s) of another shape: " + "; ".join(wrong[:8]) + (" ..." if len(wrong) > 8 else "")
        )
    if missing:
        parts.append(f"missing: {missing[:8]}{' ...' if len(missing) > 8 else ''}")
    if unexpected:
        parts.append(f"unexpected: {unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
    raise ValueError(
        f"{source} does not hold a model of the shape {target} describes ({'; '.join(parts)}); "
        f"load it with the configuration it was saved with."
    )


def _query_groups(config: GPTConfig) -> tuple[int, int, int]:
    """(key/value groups, query heads per group, head width) of ``config``."""
    groups, d = config.num_query_groups, config.kv_channels
    assert groups is not None and d is not None  # resolved by GPTConfig.__post_init__
    return groups, config.num_attention_heads // groups, d


def _fuse_qkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: GPTConfig) -> torch.Tensor:
    groups, per_group, d = _query_groups(config)
    rest = q.shape[1:]
    fused = torch.cat(
        [q.reshape(groups, per_group * d, *rest), k.reshape(groups, d, *rest), v.reshape(groups, d, *rest)], dim=1
    )
    return fused.reshape(groups * (per_group + 2) * d, *rest)


def _split_qkv(qkv: torch.Tensor, config: GPTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    groups, per_group, d = _query_groups(config)
    rest = qkv.shape[1:]
    q, k, v = qkv.reshape(groups, (per_group + 2) * d, *rest).split([per_group * d, d, d], dim=1)
    return (q.reshape(groups * per_group * d, *rest), k.reshape(groups * d, *rest), v.reshape(groups * d, *rest))


class _Tensors:
    """A mapping whose missing key is a ValueError naming the tensor and where it was looked for."""

    def __init__(self, tensors: Mapping[str, torch.Tensor], where: str):
        self.tensors, self.where = tensors, where

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.tensors:
            raise ValueError(f"{self.where} has no tensor {name!r}; it does not hold a model of its config's shape")
        return self.tensors[name]


def _gate_up(fc1: torch.Tensor, width: int, hidden: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
    """(gate, up) halves of a fused ``linear_fc1`` (flat ``[2f, ...]`` or blocked ``[2, f, ...]``)."""
    gate, up = fc1.reshape(2, width, *hidden).unbind(0)
    return gate, up


def _moe_to_state(source: _Tensors, names: _MoENames, config: GPTConfig, ours: str) -> dict[str, torch.Tensor]:
    """Our tensors (under ``ours``, the layer's ``mlp.``) of one HF MoE layer."""
    state = {ours + "router.weight": source[names.router]}
    if names.deepseek:
        state[ours + "router.expert_bias"] = source[names.expert_bias]
    if names.fused:
        fc1, fc2 = source[names.gate_up], source[names.down]
    else:
        experts = [names.expert(j) for j in range(config.num_moe_experts or 0)]
        fc1 = torch.stack([torch.cat([source[gate], source[up]]) for gate, up, _ in experts])
        fc2 = torch.stack([source[down] for _, _, down in experts])
    state.update({ours + "experts.linear_fc1.weight": fc1, ours + "experts.linear_fc2.weight": fc2})
    if config.moe_shared_expert_intermediate_size is not None:
        shared, s = ours + "shared_experts.", names.shared
        state[shared + "linear_fc1.weight"] = torch.cat([source[s + "gate_proj.weight"], source[s + "up_proj.weight"]])
        state[shared + "linear_fc2.weight"] = source[s + "down_proj.weight"]
        if config.moe_shared_expert_gate:
            state[shared + "gate_weight"] = source[names.shared_gate]
    return state


def _moe_to_hf(source: _Tensors, names: _MoENames, config: GPTConfig, ours: str) -> dict[str, torch.Tensor]:
    """One MoE layer's HF tensors, one per expert (the hub layout), from ours (under ``ours``, the layer's
    ``mlp.``; experts' ``linear_fc1`` flat ``[E, 2f, h]`` or blocked ``[E, 2, f, h]``)."""
    e, h, f = config.num_moe_experts, config.hidden_size, config.moe_ffn_hidden_size
    assert e is not None and f is not None  # an MoE config, resolved by GPTConfig.__post_init__
    out = {names.router: source[ours + "router.weight"]}
    if names.deepseek:  # a model trained without aux-loss-free balancing has no bias: DeepSeek's is then zero
        bias = source.tensors.get(ours + "router.expert_bias")
        out[names.expert_bias] = bias if bias is not None else torch.zeros(e)
    fc1 = source[ours + "experts.linear_fc1.weight"].reshape(e, 2, f, h)
    fc2 = source[ours + "experts.linear_fc2.weight"]
    for j in range(e):
        gate, up, down = names.expert(j)
        out.update({gate: fc1[j, 0], up: fc1[j, 1], down: fc2[j]})
    width = config.moe_shared_expert_intermediate_size
    if width is not None:
        shared, s = ours + "shared_experts.", names.shared
        out[s + "gate_proj.weight"], out[s + "up_proj.weight"] = _gate_up(
            source[shared + "linear_fc1.weight"], width, (h,)
        )
        out[s + "down_proj.weight"] = source[shared + "linear_fc2.weight"]
        if config.moe_shared_expert_gate:
            out[names.shared_gate] = source[shared + "gate_weight"]
    return out


def _layer_to_state(
    source: _Tensors, hf: str, ours: str, moe: _MoENames | None, config: GPTConfig, interleaved_rope: bool
) -> dict[str, torch.Tensor]:
    """Our tensors (under ``ours``) of one HF decoder layer (under ``hf``)."""
    state = {}
    state[ours + "input_layernorm.weight"] = source[hf + "input_layernorm.weight"]
    state[ours + "pre_mlp_layernorm.weight"] = source[hf + "post_attention_layernorm.weight"]
    attn, mlp = hf + "self_attn.", hf + "mlp."
    for hf_norm, our_norm in _QK_NORMS if config.qk_layernorm else ():
        state[f"{ours}self_attention.{our_norm}.weight"] = source[f"{attn}{hf_norm}.weight"]
    kinds = ["weight", "bias"] if (config.add_bias_linear or config.add_qkv_bias) else ["weight"]
    if config.multi_latent_attention:
        state.update(deepseek.attention_to_state(source, attn, ours + "self_attention.", config, interleaved_rope))
        kinds = []
    for kind in kinds:
        state[f"{ours}self_attention.linear_qkv.{kind}"] = _fuse_qkv(
            source[f"{attn}q_proj.{kind}"], source[f"{attn}k_proj.{kind}"], source[f"{attn}v_proj.{kind}"], config
        )
    if moe is not None:
        state.update(_moe_to_state(source, moe, config, ours + "mlp."))
    for kind in ["weight", "bias"] if config.add_bias_linear else ["weight"]:
        if not config.multi_latent_attention:
            state[f"{ours}self_attention.linear_proj.{kind}"] = source[f"{attn}o_proj.{kind}"]
        if moe is None:
            state[f"{ours}mlp.linear_fc1.{kind}"] = torch.cat(
                [source[f"{mlp}gate_proj.{kind}"], source[f"{mlp}up_proj.{kind}"]], dim=0
            )
            state[f"{ours}mlp.linear_fc2.{kind}"] = source[f"{mlp}down_proj.{kind}"]
    return state


def _layer_to_hf(
    source: _Tensors, hf: str, ours: str, moe: _MoENames | None, config: GPTConfig
) -> dict[str, torch.Tensor]:
    """One decoder layer's HF tensors (under ``hf``) from ours (under ``ours``)."""
    assert config.ffn_hidden_size is not None  # resolved by GPTConfig.__post_init__
    out = {}
    out[hf + "input_layernorm.weight"] = source[ours + "input_layernorm.weight"]
    out[hf + "post_attention_layernorm.weight"] = source[ours + "pre_mlp_layernorm.weight"]
    attn, mlp = hf + "self_attn.", hf + "mlp."
    for hf_norm, our_norm in _QK_NORMS if config.qk_layernorm else ():
        out[f"{attn}{hf_norm}.weight"] = source[f"{ours}self_attention.{our_norm}.weight"]
    kinds = ["weight", "bias"] if (config.add_bias_linear or config.add_qkv_bias) else ["weight"]
    if config.multi_latent_attention:
        out.update(deepseek.attention_to_hf(source, attn, ours + "self_attention.", config))
        kinds = []
    for kind in kinds:
        q, k, vv = _split_qkv(source[f"{ours}self_attention.linear_qkv.{kind}"], config)
        out.update({f"{attn}q_proj.{kind}": q, f"{attn}k_proj.{kind}": k, f"{attn}v_proj.{kind}": vv})
    if moe is not None:
        out.update(_moe_to_hf(source, moe, config, ours + "mlp."))
    for kind in ["weight", "bias"] if config.add_bias_linear else ["weight"]:
        if not config.multi_latent_attention:
            out[f"{attn}o_proj.{kind}"] = source[f"{ours}self_attention.linear_proj.{kind}"]
        if moe is None:
            rest = (config.hidden_size,) if kind == "weight" else ()
            gate_up = _gate_up(source[f"{ours}mlp.linear_fc1.{kind}"], config.ffn_hidden_size, rest)
            out[f"{mlp}gate_proj.{kind}"], out[f"{mlp}up_proj.{kind}"] = gate_up
            out[f"{mlp}down_proj.{kind}"] = source[f"{ours}mlp.linear_fc2.{kind}"]
    return out


def hf_to_state(
    tensors: Mapping[str, torch.Tensor], config: GPTConfig, interleaved_rope: bool = False
) -> dict[str, torch.Tensor]:
    """Our full state (GPTModel names, exactly ``vocab_size`` vocabulary rows, the HF dtype) from HF tensors
    whose shapes :func:`check_hf_shapes` accepted; ``interleaved_rope``: an MLA checkpoint rotating interleaved
    channel pairs (DeepSeek's ``rope_interleave``)."""
    source = _Tensors(tensors, "the HF checkpoint")
    state = {
        "embedding.weight": source["model.embed_tokens.weight"],
        "final_layernorm.weight": source["model.norm.weight"],
    }
    if not config.share_embeddings_and_output_weights:
        state["output_layer.weight"] = source["lm_head.weight"]
    fused = is_fused_expert_layout(tensors)
    for i, moe in enumerate(_moe_names(config, fused)):
        state.update(_layer_to_state(source, f"model.layers.{i}.", f"layers.{i}.", moe, config, interleaved_rope))
    for i, moe in _mtp_layers(config, fused):
        hf, ours = f"model.layers.{i}.", f"mtp.layers.{i}."
        state.update(_layer_to_state(source, hf, ours + "transformer_layer.", moe, config, interleaved_rope))
        state.update({f"{ours}{our_name}.weight": source[f"{hf}{hf_name}.weight"] for hf_name, our_name in _MTP_NAMES})
    return state


def state_to_hf(state: Mapping[str, torch.Tensor], config: GPTConfig) -> dict[str, torch.Tensor]:
    """HF tensors from our full state (any vocabulary padding; ``linear_fc1`` flat ``[2f, h]`` or blocked
    ``[2, f, h]`` as our checkpoints store it); experts one tensor each, as transformers' ``save_pretrained``."""
    source = _Tensors(state, "the model state")
    v = config.vocab_size
    out = {
        "model.embed_tokens.weight": fit_vocab_rows(source["embedding.weight"], v),
        "model.norm.weight": source["final_layernorm.weight"],
    }
    if not config.share_embeddings_and_output_weights:
        out["lm_head.weight"] = fit_vocab_rows(source["output_layer.weight"], v)
    assert config.ffn_hidden_size is not None  # resolved by GPTConfig.__post_init__
    for i, moe in enumerate(_moe_names(config, fused=False)):
        out.update(_layer_to_hf(source, f"model.layers.{i}.", f"layers.{i}.", moe, config))
    for i, moe in _mtp_layers(config, fused=False):
        hf, ours = f"model.layers.{i}.", f"mtp.layers.{i}."
        out.update(_layer_to_hf(source, hf, ours + "transformer_layer.", moe, config))
        out.update({f"{hf}{hf_name}.weight": source[f"{ours}{our_name}.weight"] for hf_name, our_name in _MTP_NAMES})
        # copies (safetensors refuses tensors that share memory)
        out[hf + "embed_tokens.weight"] = out["model.embed_tokens.weight"].clone()
        out[hf + "shared_head.head.weight"] = out.get("lm_head.weight", out["model.embed_tokens.weight"]).clone()
    return {name: t.contiguous() for name, t in out.items()}

"""GPTConfig: the model's shape, with Megatron's field names and validation."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields
from typing import Literal, Optional, Union

from megatron_lite.core.models.rope import RopeScaling

NORMALIZATIONS = ("RMSNorm", "LayerNorm")
ACTIVATIONS = ("swiglu", "gelu")
POSITION_EMBEDDINGS = ("rope", "learned_absolute")
RECOMPUTE_GRANULARITIES = ("full", "selective")
RECOMPUTE_METHODS = ("uniform", "block")
RECOMPUTE_MODULES = ("core_attn", "moe")
ROPE_SCALING_TYPES = ("linear", "llama3", "yarn")
# Llama 3.1's published values (also Megatron-LM's defaults for --use-rope-scaling).
LLAMA3_ROPE_DEFAULTS = {
    "rope_scaling_factor": 8.0,
    "rope_low_freq_factor": 1.0,
    "rope_high_freq_factor": 4.0,
    "rope_original_max_position_embeddings": 8192,
}
# YaRN's published defaults (Peng et al. 2023; transformers' and Megatron's): the ramp's bounds in rotations and
# the log-factor multipliers of the attention scale (mscale_all_dim 0: no softmax rescaling).
YARN_ROPE_DEFAULTS = {"rope_beta_fast": 32.0, "rope_beta_slow": 1.0, "rope_mscale": 1.0, "rope_mscale_all_dim": 0.0}
MLA_SHAPE_FIELDS = ("kv_lora_rank", "qk_head_dim", "qk_pos_emb_head_dim", "v_head_dim")


@dataclass
class GPTConfig:
    """Shape and options of a GPT model (defaults: a tiny Llama-style model).

    The shape fields whose None means "derive it" (num_query_groups, ffn_hidden_size, kv_channels,
    max_position_embeddings) hold their resolved ints once the config is built (``__post_init__``)."""

    num_layers: int = 2
    """Transformer layers."""
    hidden_size: int = 64
    """Width of the residual stream."""
    num_attention_heads: int = 4
    """Query heads."""
    num_query_groups: Optional[int] = None
    """Key/value heads for grouped-query attention; None means one per query head (MHA)."""
    ffn_hidden_size: Optional[int] = None
    """MLP inner width; None means 4 x hidden_size."""
    kv_channels: Optional[int] = None
    """Width of one attention head; None means hidden_size / num_attention_heads."""
    vocab_size: int = 1024
    """Tokenizer vocabulary size (padded internally, see make_vocab_size_divisible_by)."""
    seq_length: int = 128
    """Training sequence length."""
    max_position_embeddings: Optional[int] = None
    """Size of the learned position table; None means seq_length."""
    normalization: Literal["RMSNorm", "LayerNorm"] = "RMSNorm"
    """Normalization layer."""
    layernorm_epsilon: float = 1e-5
    """Epsilon of the normalization layers."""
    activation: Literal["swiglu", "gelu"] = "swiglu"
    """MLP activation: gated SiLU (Llama) or GeLU (GPT-2)."""
    position_embedding_type: Literal["rope", "learned_absolute"] = "rope"
    """Rotary position embedding or a learned absolute position table."""
    rotary_base: float = 10000.0
    """RoPE base frequency (theta: 10000 for Llama 2, 500000 for Llama 3)."""
    rotary_percent: float = 1.0
    """Fraction of each head's channels that RoPE rotates."""
    rope_scaling_type: Optional[Literal["linear", "llama3", "yarn"]] = None
    """RoPE frequency scaling for contexts past pre-training's: 'linear' (every frequency / factor), 'llama3'
    (Llama 3.1: long wavelengths / factor, short ones kept, a smooth blend between), 'yarn' (DeepSeek's YaRN,
    with multi_latent_attention), or None."""
    rope_scaling_factor: Optional[float] = None
    """How much the context is stretched (with rope_scaling_type; 'llama3' defaults to Llama 3.1's 8)."""
    rope_low_freq_factor: Optional[float] = None
    """'llama3': wavelengths longer than original_max_position_embeddings / this are divided by the factor (def. 1)."""
    rope_high_freq_factor: Optional[float] = None
    """'llama3': wavelengths shorter than original_max_position_embeddings / this are kept (default 4)."""
    rope_original_max_position_embeddings: Optional[int] = None
    """'llama3'/'yarn': the context length of pre-training the scaling starts from (default 8192 for 'llama3')."""
    rope_beta_fast: Optional[float] = None
    """'yarn': frequencies turning more than this many times over the original context are kept (default 32)."""
    rope_beta_slow: Optional[float] = None
    """'yarn': frequencies turning fewer than this many times are divided by the factor (default 1)."""
    rope_mscale: Optional[float] = None
    """'yarn': cos/sin are scaled by mscale(factor, rope_mscale) / mscale(factor, rope_mscale_all_dim) (default 1)."""
    rope_mscale_all_dim: Optional[float] = None
    """'yarn': the softmax scale is multiplied by mscale(factor, this)^2 (DeepSeek-V3: 1; default 0: unchanged)."""
    share_embeddings_and_output_weights: bool = False
    """Tie the output layer to the word embedding."""
    add_bias_linear: bool = False
    """Biases in the linear layers (GPT-2 style)."""
    add_qkv_bias: bool = False
    """Bias in the QKV projection only (Qwen style)."""
    qk_layernorm: bool = False
    """Normalize each query and key head (over kv_channels, with the model's normalization) before RoPE (Qwen3)."""
    # --- Multi-latent attention (DeepSeek-V2/V3; Megatron's names; checked in _validate_mla) ---
    multi_latent_attention: bool = False
    """Multi-latent attention: keys and values from a compressed latent, RoPE on a decoupled part of each head."""
    q_lora_rank: Optional[int] = None
    """MLA: width of the compressed query latent; None projects the queries straight from the hidden state."""
    kv_lora_rank: Optional[int] = None
    """MLA: width of the compressed key/value latent (needed with multi_latent_attention)."""
    qk_head_dim: Optional[int] = None
    """MLA: channels of a query/key head without position (DeepSeek's qk_nope_head_dim)."""
    qk_pos_emb_head_dim: Optional[int] = None
    """MLA: channels of a query/key head RoPE rotates; the key's are shared by every head (qk_rope_head_dim)."""
    v_head_dim: Optional[int] = None
    """MLA: channels of a value head."""
    hidden_dropout: float = 0.0
    """Dropout on the residual branches and the embedding."""
    attention_dropout: float = 0.0
    """Dropout on the attention probabilities."""
    init_method_std: float = 0.02
    """Standard deviation of the normal weight init (output projections are scaled by 1/sqrt(2L))."""
    make_vocab_size_divisible_by: int = 128
    """Pad the vocabulary to a multiple of this x the TP size (Megatron's padding; masked, never in the model)."""
    recompute_granularity: Optional[Literal["full", "selective"]] = None
    """Activation recomputation in training: whole layers ('full'), only the core attention ('selective'), or none."""
    recompute_method: Optional[Literal["uniform", "block"]] = None
    """With 'full': checkpoint groups of recompute_num_layers layers ('uniform') or the first ones ('block')."""
    recompute_num_layers: Optional[int] = None
    """With 'full': layers per checkpointed group ('uniform') or layers checkpointed one by one ('block')."""
    recompute_modules: Optional[list[str]] = None
    """With 'selective': what is recomputed, Megatron's names: 'core_attn' (the default) and/or 'moe' (MoE layers)."""
    # --- Mixture of Experts (Megatron's names and defaults; checked in core/models/moe_config.py) ---
    num_moe_experts: Optional[int] = None
    """Experts per MoE layer; None means a dense model (every other moe_* field must then keep its default)."""
    moe_layer_freq: Union[int, list[int]] = 1
    """Which layers are MoE: every N-th (int N; layer i is MoE when i % N == 0) or a 0/1 list of num_layers entries."""
    moe_ffn_hidden_size: Optional[int] = None
    """Inner width of one expert; None means ffn_hidden_size."""
    moe_router_topk: int = 2
    """Experts each token is routed to."""
    moe_router_score_function: Literal["softmax", "sigmoid"] = "softmax"
    """How router logits become scores."""
    moe_router_pre_softmax: bool = False
    """Softmax over all experts before the top-k (Mixtral normalises after it, over the chosen k)."""
    moe_router_topk_scaling_factor: Optional[float] = None
    """Multiply the chosen experts' weights by this (DeepSeek's routed_scaling_factor)."""
    moe_router_num_groups: Optional[int] = None
    """Group-limited routing: experts form this many groups (DeepSeek's n_group)."""
    moe_router_group_topk: Optional[int] = None
    """Group-limited routing: tokens pick experts from this many best groups (DeepSeek's topk_group)."""
    moe_router_dtype: Optional[Literal["fp32", "fp64"]] = None
    """Precision of the router's logits and scores; None means fp32."""
    moe_input_jitter_eps: Optional[float] = None
    """Multiply router inputs by uniform noise in [1-eps, 1+eps] in training (Switch Transformer)."""
    moe_router_load_balancing_type: Literal["aux_loss", "seq_aux_loss", "global_aux_loss", "sinkhorn", "none"] = (
        "aux_loss"
    )
    """Load balancing: an auxiliary loss over the micro-batch, per sequence or over the global batch, Sinkhorn, none."""
    moe_aux_loss_coeff: float = 0.0
    """Weight of the load-balancing auxiliary loss (0: computed nowhere)."""
    moe_z_loss_coeff: Optional[float] = None
    """Weight of the router z-loss (ST-MoE); None: off."""
    moe_router_enable_expert_bias: bool = False
    """Aux-loss-free balancing (DeepSeek-V3): a per-expert bias added for the choice only, updated every step."""
    moe_router_bias_update_rate: float = 1e-3
    """Step of the expert-bias update (towards the mean load), per optimizer step."""
    moe_expert_capacity_factor: Optional[float] = None
    """Tokens an expert takes, as a multiple of the even share; None means dropless."""
    moe_token_drop_policy: Literal["probs", "position"] = "probs"
    """Over capacity, drop the tokens with the lowest routing weight ('probs') or the latest ones ('position')."""
    moe_pad_expert_input_to_capacity: bool = False
    """Pad every expert's input to its capacity (fixed shapes; needs moe_expert_capacity_factor)."""
    moe_shared_expert_intermediate_size: Optional[int] = None
    """Inner width of the shared expert every token goes through (Qwen2-MoE, DeepSeek); None: none."""
    moe_shared_expert_gate: bool = False
    """Scale the shared expert's output by a learned sigmoid gate per token (Qwen2-MoE)."""
    moe_grouped_gemm: bool = False
    """Run the local experts as one grouped GEMM (torch._grouped_mm) where it runs, else one GEMM per expert."""
    moe_token_dispatcher_type: Literal["allgather", "alltoall", "flex"] = "allgather"
    """How tokens reach their experts' ranks: all-gather, all-to-all, or DeepEP ('flex', needs deep_ep)."""
    # --- Multi-token prediction (DeepSeek-V3; Megatron's names; see core/models/mtp.py) ---
    mtp_num_layers: Optional[int] = None
    """Multi-token prediction depths on the last stage, each predicting one token further ahead (None or 0: off)."""
    mtp_loss_scaling_factor: float = 0.1
    """Weight of the MTP loss: this / mtp_num_layers x the sum of the depths' losses is added to the main loss."""

    def __post_init__(self) -> None:
        _refuse_non_finite(self)
        for name in (
            "num_layers",
            "hidden_size",
            "num_attention_heads",
            "vocab_size",
            "seq_length",
            "make_vocab_size_divisible_by",
        ):
            _positive_int(name, getattr(self, name))
        for name in ("num_query_groups", "ffn_hidden_size", "kv_channels", "max_position_embeddings"):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        self._validate_mla()
        if self.num_query_groups is None:
            self.num_query_groups = self.num_attention_heads
        if self.ffn_hidden_size is None:
            self.ffn_hidden_size = 4 * self.hidden_size
        if self.kv_channels is None:
            if self.hidden_size % self.num_attention_heads != 0:
                raise ValueError(
                    f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                    f"({self.num_attention_heads}), or set kv_channels explicitly."
                )
            self.kv_channels = self.hidden_size // self.num_attention_heads
        if self.max_position_embeddings is None:
            self.max_position_embeddings = self.seq_length
        if self.num_attention_heads % self.num_query_groups != 0:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be divisible by num_query_groups "
                f"({self.num_query_groups})."
            )
        if self.normalization not in NORMALIZATIONS:
            raise ValueError(f"normalization must be one of {NORMALIZATIONS}, got {self.normalization!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {ACTIVATIONS}, got {self.activation!r}")
        if self.position_embedding_type not in POSITION_EMBEDDINGS:
            raise ValueError(
                f"position_embedding_type must be one of {POSITION_EMBEDDINGS}, got {self.position_embedding_type!r}"
            )
        if self.position_embedding_type == "learned_absolute" and self.max_position_embeddings < self.seq_length:
            raise ValueError(
                f"max_position_embeddings ({self.max_position_embeddings}) must be >= seq_length ({self.seq_length})."
            )
        if self.position_embedding_type == "rope" and not self.multi_latent_attention and self.kv_channels % 2:
            raise ValueError(f"RoPE needs an even head width, got kv_channels={self.kv_channels}")
        for name in ("hidden_dropout", "attention_dropout"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise ValueError(f"{name} must be in [0, 1), got {getattr(self, name)}")
        if (
            isinstance(self.rotary_base, bool)
            or not isinstance(self.rotary_base, (int, float))
            or self.rotary_base <= 0
        ):
            raise ValueError(f"rotary_base must be a positive number, got {self.rotary_base!r}")
        self._validate_rope_scaling()
        if not 0.0 < self.rotary_percent <= 1.0:
            raise ValueError(f"rotary_percent must be in (0, 1], got {self.rotary_percent}")
        if self.init_method_std <= 0:
            raise ValueError(f"init_method_std must be positive, got {self.init_method_std}")
        self._validate_recompute()
        from megatron_lite.core.models.moe_config import check_moe_fields

        check_moe_fields(self)
        from megatron_lite.core.models.mtp_config import check_mtp_fields

        check_mtp_fields(self)

    def _validate_mla(self) -> None:
        """MLA's shape fields come together (and only with it); what MLA does not support yet is refused by name.
        Resolves kv_channels to a query/key head's width and num_query_groups to one per head."""
        if not self.multi_latent_attention:
            given = [name for name in ("q_lora_rank", *MLA_SHAPE_FIELDS) if getattr(self, name) is not None]
            if given:
                raise ValueError(f"{given} only apply to multi-latent attention; set multi_latent_attention=True.")
            return
        missing = [name for name in MLA_SHAPE_FIELDS if getattr(self, name) is None]
        if missing:
            raise ValueError(f"multi_latent_attention=True needs {missing}: set them (DeepSeek-V3: 512, 128, 64, 128).")
        for name in ("q_lora_rank", *MLA_SHAPE_FIELDS):
            if getattr(self, name) is not None:
                _positive_int(name, getattr(self, name))
        assert self.qk_head_dim is not None and self.qk_pos_emb_head_dim is not None  # checked just above
        width = self.qk_head_dim + self.qk_pos_emb_head_dim
        if self.kv_channels not in (None, width):
            raise ValueError(
                f"kv_channels={self.kv_channels} with multi_latent_attention: a query/key head is qk_head_dim + "
                f"qk_pos_emb_head_dim = {width} wide; leave kv_channels unset."
            )
        if self.num_query_groups not in (None, self.num_attention_heads):
            raise ValueError(
                f"num_query_groups={self.num_query_groups} with multi_latent_attention: MLA expands one key and value "
                f"per query head from the latent; leave num_query_groups unset."
            )
        if self.position_embedding_type != "rope":
            raise ValueError("multi_latent_attention needs position_embedding_type='rope' (its decoupled RoPE part).")
        if self.qk_pos_emb_head_dim % 2:
            raise ValueError(f"RoPE needs an even width, got qk_pos_emb_head_dim={self.qk_pos_emb_head_dim}.")
        unsupported = [
            (self.rotary_percent != 1.0, f"rotary_percent={self.rotary_percent} (MLA rotates its whole RoPE part)"),
            (self.qk_layernorm, "qk_layernorm=True (MLA normalizes its latents instead)"),
            (self.add_qkv_bias, "add_qkv_bias=True"),
            (self.add_bias_linear, "add_bias_linear=True"),
        ]
        refused = [why for bad, why in unsupported if bad]
        if refused:
            raise ValueError(f"multi_latent_attention does not support {'; '.join(refused)}: turn it off.")
        self.kv_channels = width
        self.num_query_groups = self.num_attention_heads

    def _validate_rope_scaling(self) -> None:
        """The scaling fields belong to one scaling type each; 'llama3' and 'yarn' fill in their published values."""
        kind = self.rope_scaling_type
        llama3_only = ("rope_low_freq_factor", "rope_high_freq_factor")
        yarn_only = tuple(YARN_ROPE_DEFAULTS)
        if kind != "yarn":
            for name in yarn_only:
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} only applies to rope_scaling_type='yarn'; leave it unset."
                    )
        if kind is None:
            for name in ("rope_scaling_factor", *llama3_only, "rope_original_max_position_embeddings"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} needs rope_scaling_type ('linear' or 'llama3'); "
                        f"set rope_scaling_type or leave {name} unset."
                    )
            return
        if kind not in ROPE_SCALING_TYPES:
            raise ValueError(f"rope_scaling_type must be None or one of {ROPE_SCALING_TYPES}, got {kind!r}")
        if self.position_embedding_type != "rope":
            raise ValueError(f"rope_scaling_type={kind!r} needs position_embedding_type='rope'.")
        if kind == "yarn":
            if not self.multi_latent_attention:
                raise ValueError(
                    "rope_scaling_type='yarn' is implemented for multi_latent_attention models (DeepSeek's YaRN, "
                    "with its softmax rescaling); use 'linear' or 'llama3', or set multi_latent_attention=True."
                )
            for name in llama3_only:
                if getattr(self, name) is not None:
                    raise ValueError(f"{name} only applies to rope_scaling_type='llama3' (got 'yarn'); leave it unset.")
            if self.rope_scaling_factor is None or self.rope_original_max_position_embeddings is None:
                raise ValueError(
                    "rope_scaling_type='yarn' needs rope_scaling_factor and rope_original_max_position_embeddings "
                    "(DeepSeek-V3: 40 and 4096)."
                )
            _positive_int("rope_original_max_position_embeddings", self.rope_original_max_position_embeddings)
            for name, default in YARN_ROPE_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)
            assert self.rope_beta_fast is not None and self.rope_beta_slow is not None  # just filled in
            if not 0 < self.rope_beta_slow < self.rope_beta_fast:
                raise ValueError(
                    f"rope_beta_slow ({self.rope_beta_slow}) must be positive and below rope_beta_fast "
                    f"({self.rope_beta_fast})."
                )
        elif kind == "linear":
            for name in (*llama3_only, "rope_original_max_position_embeddings"):
                if getattr(self, name) is not None:
                    raise ValueError(
                        f"{name} only applies to rope_scaling_type='llama3' (got 'linear'); leave it unset."
                    )
            if self.rope_scaling_factor is None:
                raise ValueError("rope_scaling_type='linear' needs rope_scaling_factor (positions are divided by it).")
        else:
            for name, default in LLAMA3_ROPE_DEFAULTS.items():
                if getattr(self, name) is None:
                    setattr(self, name, default)
            low, high = self.rope_low_freq_factor, self.rope_high_freq_factor
            assert low is not None and high is not None  # the defaults just filled them in
            _positive_int("rope_original_max_position_embeddings", self.rope_original_max_position_embeddings)
            if not 0 < low < high:
                raise ValueError(
                    f"rope_low_freq_factor ({low}) must be positive and below rope_high_freq_factor ({high})."
                )
        if (
            isinstance(self.rope_scaling_factor, bool)
            or not isinstance(self.rope_scaling_factor, (int, float))
            or self.rope_scaling_factor <= 0
        ):
            raise ValueError(f"rope_scaling_factor must be a positive number, got {self.rope_scaling_factor!r}")

    def recomputes(self, module: str) -> bool:
        """Whether 'selective' recompute reruns ``module`` ('core_attn' or 'moe') in the backward pass."""
        if self.recompute_granularity != "selective":
            return False
        return module in (self.recompute_modules if self.recompute_modules is not None else ("core_attn",))

    def rope_scaling(self) -> Optional[RopeScaling]:
        """The RoPE frequency scaling these fields describe (None: plain RoPE)."""
        if self.rope_scaling_type is None:
            return None
        # _validate_rope_scaling refused a scaling type without a factor
        assert self.rope_scaling_factor is not None
        return RopeScaling(
            self.rope_scaling_type,
            float(self.rope_scaling_factor),
            low_freq_factor=float(self.rope_low_freq_factor or 1.0),
            high_freq_factor=float(self.rope_high_freq_factor or 4.0),
            original_max_position_embeddings=self.rope_original_max_position_embeddings or 8192,
            beta_fast=float(self.rope_beta_fast or 32.0),
            beta_slow=float(self.rope_beta_slow or 1.0),
            mscale=float(self.rope_mscale if self.rope_mscale is not None else 1.0),
            mscale_all_dim=float(self.rope_mscale_all_dim or 0.0),
        )

    def _validate_recompute(self) -> None:
        """Megatron's rules for the three recompute options (and no silently ignored option)."""
        granularity, method, count = self.recompute_granularity, self.recompute_method, self.recompute_num_layers
        if granularity is not None and granularity not in RECOMPUTE_GRANULARITIES:
            raise ValueError(
                f"recompute_granularity must be None or one of {RECOMPUTE_GRANULARITIES}, got {granularity!r}"
            )
        if method is not None and method not in RECOMPUTE_METHODS:
            raise ValueError(f"recompute_method must be None or one of {RECOMPUTE_METHODS}, got {method!r}")
        if count is not None:
            _positive_int("recompute_num_layers", count)
        modules = self.recompute_modules
        if modules is not None:
            if granularity != "selective":
                raise ValueError(
                    f"recompute_modules={modules!r} only applies to recompute_granularity='selective' (got "
                    f"{granularity!r}); set recompute_granularity='selective' or leave recompute_modules unset."
                )
            unknown = sorted(set(modules) - set(RECOMPUTE_MODULES))
            if unknown or not modules:
                raise ValueError(f"recompute_modules must name some of {RECOMPUTE_MODULES}, got {modules!r}")
            if "moe" in modules and self.num_moe_experts is None:
                raise ValueError("recompute_modules=['moe'] recomputes MoE layers, and this model has none.")
        if granularity != "full":
            for name, value in (("recompute_method", method), ("recompute_num_layers", count)):
                if value is not None:
                    raise ValueError(
                        f"{name}={value!r} only applies to recompute_granularity='full' (got {granularity!r}); "
                        f"set recompute_granularity='full' or leave {name} unset."
                    )
            return
        if method is None:
            raise ValueError(
                "recompute_granularity='full' needs recompute_method: set it to 'uniform' "
                "(checkpoint groups of recompute_num_layers layers) or 'block' (checkpoint the first "
                "recompute_num_layers layers)."
            )
        if count is None:
            raise ValueError(
                "recompute_granularity='full' needs recompute_num_layers: set it to a number of "
                f"layers between 1 and num_layers ({self.num_layers})."
            )
        if count > self.num_layers:
            raise ValueError(
                f"recompute_num_layers ({count}) must be <= num_layers ({self.num_layers}); lower recompute_num_layers."
            )

    def validate_parallelism(
        self,
        tensor_model_parallel_size: int = 1,
        pipeline_model_parallel_size: int = 1,
        context_parallel_size: int = 1,
        sequence_parallel: bool = False,
    ) -> None:
        """Raise a ValueError naming the fix if this model cannot be split this way."""
        tp = tensor_model_parallel_size
        assert self.num_query_groups is not None and self.ffn_hidden_size is not None  # resolved by __post_init__
        checks = [
            (self.num_attention_heads, "num_attention_heads"),
            (self.num_query_groups, "num_query_groups"),
            (self.ffn_hidden_size, "ffn_hidden_size"),
        ]
        for value, name in checks:
            if value % tp != 0:
                raise ValueError(
                    f"{name} ({value}) must be divisible by tensor_model_parallel_size ({tp}); "
                    f"choose a tensor_model_parallel_size that divides {value} or change {name}."
                )
        # How the layers split over pipeline stages (even, uneven, virtual) is checked by
        # ParallelConfig.stage_chunks, which knows the cut.
        if sequence_parallel and self.seq_length % tp != 0:
            raise ValueError(
                f"seq_length ({self.seq_length}) must be divisible by tensor_model_parallel_size ({tp}) "
                f"with sequence_parallel=True."
            )
        if context_parallel_size > 1 and self.seq_length % (2 * context_parallel_size) != 0:
            raise ValueError(
                f"seq_length ({self.seq_length}) must be divisible by 2 x context_parallel_size "
                f"({2 * context_parallel_size})."
            )

    def padded_vocab_size(self, tensor_model_parallel_size: int = 1) -> int:
        """The vocabulary size the embedding and output layer actually use (Megatron's padding)."""
        multiple = self.make_vocab_size_divisible_by * tensor_model_parallel_size
        return -(-self.vocab_size // multiple) * multiple

    def num_parameters(self) -> int:
        """Parameters of the model with its padded vocabulary at TP=1 (for reports), every expert counted."""
        return self._count_parameters(active=False)

    def num_active_parameters(self) -> int:
        """Parameters one token goes through (for FLOPs): an MoE layer's router, top-k experts and shared expert
        instead of all its experts; ``num_parameters()`` for a dense model."""
        return self._count_parameters(active=True)

    def _count_parameters(self, active: bool) -> int:
        from megatron_lite.core.models.moe_sizes import mlp_side_parameters

        h, L, v = self.hidden_size, self.num_layers, self.padded_vocab_size()
        assert (
            self.num_query_groups is not None
            and self.kv_channels is not None
            and self.max_position_embeddings is not None
        )  # resolved by __post_init__
        q = self.num_attention_heads * self.kv_channels
        kv = 2 * self.num_query_groups * self.kv_channels
        norm = 2 * h if self.normalization == "LayerNorm" else h
        attn = h * (q + kv) + q * h
        biases = 0
        if self.add_bias_linear:
            biases = (q + kv) + h
        elif self.add_qkv_bias:
            biases = q + kv
        # qk_layernorm: one norm of a head's width for the queries, one for the keys (shared by every head)
        qk_norms = 2 * self.kv_channels * (2 if self.normalization == "LayerNorm" else 1) if self.qk_layernorm else 0
        if self.multi_latent_attention:
            attn, biases, qk_norms = self.mla_parameters(), 0, 0
        per_layer = attn + biases + 2 * norm + qk_norms
        emb = v * h + (self.max_position_embeddings * h if self.position_embedding_type == "learned_absolute" else 0)
        out = 0 if self.share_embeddings_and_output_weights else v * h
        return (
            L * per_layer
            + mlp_side_parameters(self, active)
            + emb
            + out
            + norm
            + self._mtp_parameters(per_layer, active)
        )

    def _mtp_parameters(self, per_layer: int, active: bool) -> int:
        """The multi-token prediction depths': each a layer (``per_layer`` without its MLP, which is of the last
        layer's kind), its three norms and the ``2H -> H`` projection."""
        from megatron_lite.core.models.moe_config import moe_layer_pattern
        from megatron_lite.core.models.moe_sizes import mlp_parameters, moe_layer_parameters

        assert self.ffn_hidden_size is not None  # resolved by __post_init__
        depth, h = self.mtp_num_layers or 0, self.hidden_size
        if not depth:
            return 0
        mlp = (
            moe_layer_parameters(self, active)
            if moe_layer_pattern(self)[-1]
            else mlp_parameters(self, self.ffn_hidden_size)
        )
        norm = 2 * h if self.normalization == "LayerNorm" else h
        return depth * (per_layer + mlp + 3 * norm + 2 * h * h)

    def mla_parameters(self, norms: bool = True) -> int:
        """One multi-latent attention's parameters: projections and (with ``norms``) latent norms (no biases)."""
        assert self.kv_lora_rank and self.qk_head_dim and self.qk_pos_emb_head_dim and self.v_head_dim  # MLA's
        h, heads = self.hidden_size, self.num_attention_heads
        per_norm = (2 if self.normalization == "LayerNorm" else 1) if norms else 0
        q_width = heads * (self.qk_head_dim + self.qk_pos_emb_head_dim)
        if self.q_lora_rank is None:
            q = h * q_width
        else:
            q = h * self.q_lora_rank + per_norm * self.q_lora_rank + self.q_lora_rank * q_width
        kv = h * (self.kv_lora_rank + self.qk_pos_emb_head_dim) + per_norm * self.kv_lora_rank
        kv += self.kv_lora_rank * heads * (self.qk_head_dim + self.v_head_dim)
        return q + kv + heads * self.v_head_dim * h


def refuse_mla(config: object, feature: str) -> None:
    """Refuse, naming it, a feature that does not handle multi-latent attention yet (rather than fail deep inside on
    the attention's layers, which are not the fused QKV it expects)."""
    if getattr(config, "multi_latent_attention", False):
        raise ValueError(
            f"{feature} does not handle multi-latent attention yet (this model has multi_latent_attention=True); "
            f"use a model without MLA for it."
        )


def _positive_int(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def _refuse_non_finite(config: GPTConfig) -> None:
    # NaN passes every range check (all comparisons are False) and would surface only after launch, as
    # NaN weights (init_method_std) or activations (layernorm_epsilon) and a NaN gradient norm.
    for f in fields(config):
        value = getattr(config, f.name)
        if isinstance(value, float) and not math.isfinite(value):
            raise ValueError(
                f"GPTConfig({f.name}={value}): {f.name} must be a finite number; pass a finite "
                f"{f.name} (the default is {f.default!r})."
            )

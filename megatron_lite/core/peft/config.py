"""LoRAConfig: what a LoRA fine-tune adds to a model (NeMo / Megatron-Bridge's names and defaults)."""

from __future__ import annotations

import dataclasses
import fnmatch
from typing import Literal

LINEAR_MODULES = ("linear_qkv", "linear_proj", "linear_fc1", "linear_fc2")
"""The linear layers of our transformer layers, by Megatron's names: attention's fused QKV (column-parallel) and
output projection (row-parallel), the MLP's fc1 ([gate; up] for SwiGLU, column-parallel) and fc2 (row-parallel).
In an MoE layer ``linear_fc1``/``linear_fc2`` are also the experts' (and the shared expert's)."""

MLA_LINEAR_MODULES = (
    "linear_q_proj",
    "linear_q_down_proj",
    "linear_q_up_proj",
    "linear_kv_down_proj",
    "linear_kv_up_proj",
)
"""Multi-latent attention's projections besides ``linear_proj`` (Megatron's names): the query projection without
query compression, else its down (replicated) and up (column-parallel) projections, and the key/value latent's
down (replicated) and up (column-parallel) projections."""

TARGET_NAMES = LINEAR_MODULES + MLA_LINEAR_MODULES
"""Every layer name a ``target_modules`` entry may give."""

ALL_LINEAR = "all-linear"
"""The ``target_modules`` entry selecting every linear layer the model has among :data:`TARGET_NAMES` (PEFT's name):
the four of a GPT layer; on an MLA model its query/key/value projections instead of ``linear_qkv`` (Megatron-Bridge's
all-linear set for DeepSeek). The default."""

A_INIT_METHODS = ("xavier", "normal")


@dataclasses.dataclass
class LoRAConfig:
    """Low-rank adapters ``W x + (alpha / dim) * B A x`` on a model's linear layers, the base frozen."""

    dim: int = 32
    """Rank of each adapter (``A`` is ``[dim, in]``, ``B`` ``[out, dim]``)."""
    alpha: float = 32.0
    """Scale numerator: the adapter's output is multiplied by ``alpha / dim``."""
    dropout: float = 0.0
    """Dropout probability on the adapter's path (never on the base's)."""
    dropout_position: Literal["pre", "post"] = "pre"
    """Where the dropout sits: on the adapter's input ("pre", Bridge's default) or on its output ("post")."""
    target_modules: list[str] = dataclasses.field(default_factory=lambda: [ALL_LINEAR])
    """Layers to adapt: ``"all-linear"`` (every linear layer of the model), names from :data:`TARGET_NAMES`, or
    patterns over full module names with ``*`` (``"*.layers.0.*.linear_qkv"``: layer 0's QKV only)."""
    lora_A_init_method: Literal["xavier", "normal"] = "xavier"
    """How ``A`` is drawn: "xavier" (normal with std sqrt(2 / (in + dim)), Bridge's default) or "normal" (std 0.02);
    ``B`` starts at zero, so the adapted model starts as the base."""

    def __post_init__(self) -> None:
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim <= 0:
            raise ValueError(f"LoRA dim={self.dim!r} must be a positive integer (the adapters' rank, e.g. 8 or 16)")
        if not isinstance(self.alpha, (int, float)) or isinstance(self.alpha, bool) or self.alpha <= 0:
            raise ValueError(f"LoRA alpha={self.alpha!r} must be a positive number (the scale is alpha / dim)")
        self.alpha = float(self.alpha)
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LoRA dropout={self.dropout!r} must lie in [0, 1)")
        if self.dropout_position not in ("pre", "post"):
            raise ValueError(f"LoRA dropout_position={self.dropout_position!r} must be 'pre' or 'post'")
        if self.lora_A_init_method not in A_INIT_METHODS:
            raise ValueError(
                f"LoRA lora_A_init_method={self.lora_A_init_method!r} must be one of {A_INIT_METHODS} "
                f"(B always starts at zero)"
            )
        if isinstance(self.target_modules, str):
            self.target_modules = [self.target_modules]
        self.target_modules = list(self.target_modules)
        if not self.target_modules:
            raise ValueError(
                f"LoRA target_modules is empty: name the layers to adapt, e.g. {[ALL_LINEAR]} or {list(LINEAR_MODULES)}"
            )
        for target in self.target_modules:
            if not is_pattern(target) and target not in (ALL_LINEAR, *TARGET_NAMES):
                raise ValueError(
                    f"LoRA target_modules: {target!r} is not a linear layer of this model; the valid names are "
                    f"{[ALL_LINEAR, *TARGET_NAMES]} (or a pattern over full module names such as "
                    f"'*.layers.0.*.linear_qkv')"
                )

    @property
    def scale(self) -> float:
        """``alpha / dim``: what the adapter's output is multiplied by."""
        return self.alpha / self.dim

    def selects(self, module_name: str) -> bool:
        """Whether the linear layer named ``module_name`` (its full name in the model) is to be adapted."""
        short = module_name.rsplit(".", 1)[-1]
        return any(
            fnmatch.fnmatchcase(module_name, target)
            if is_pattern(target)
            else short == target or (target == ALL_LINEAR and short in TARGET_NAMES)
            for target in self.target_modules
        )


def is_pattern(target: str) -> bool:
    """Whether a ``target_modules`` entry is a pattern over full module names rather than a layer's name."""
    return "*" in target or "?" in target or "." in target

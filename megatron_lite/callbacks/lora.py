"""LoRA: fine-tune low-rank adapters on a frozen model with ``trainer.fit``, under any layout.

``Trainer(callbacks=[ml.callbacks.LoRA(dim=8, alpha=16)])`` (CLI: ``--trainer.callbacks+=megatron_lite.callbacks.LoRA
--trainer.callbacks.dim 8``) adds an objective extension to the module in ``setup``; once each rank's model is built
it gets an adapter on every targeted linear layer (sharded like the layer, :mod:`megatron_lite.core.peft.lora`) and
every other parameter is frozen, before the optimizer exists: only the adapters have gradients, gradient buffers and
optimizer state. The training step, schedules and reductions are the pretraining ones.

The adapted model carries its recipe (a ``megatron_lite_lora`` buffer): checkpoints, the model a forked fit hands
back to a notebook, and a validate/predict at another layout keep the adapters without this callback.
"""

from __future__ import annotations

from typing import Any, Literal, Optional, Sequence

import lightning.pytorch as pl

from megatron_lite.core.engine.extensions import ObjectiveExtension, add_extension
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.core.peft import ALL_LINEAR, LoRAConfig, apply_lora, lora_recipe
from megatron_lite.core.peft.lora import check_targets


class LoRA(pl.Callback):
    """Train LoRA adapters ``W x + (alpha / dim) B A x`` on the module's frozen model (NeMo / Megatron-Bridge names).

    Args:
        dim: the adapters' rank.
        alpha: the scale's numerator (scale = alpha / dim).
        dropout: dropout probability on the adapters' path.
        dropout_position: "pre" (on the adapter's input) or "post" (on its output).
        target_modules: linear layers to adapt: ``"all-linear"`` (every linear layer of the model, the default),
            Megatron's names (``linear_qkv``, ``linear_proj``, ``linear_fc1``, ``linear_fc2``; on an MLA model
            ``linear_q_proj`` or ``linear_q_down_proj``/``linear_q_up_proj``, ``linear_kv_down_proj``,
            ``linear_kv_up_proj`` instead of ``linear_qkv``) or patterns over full names
            (``"*.layers.0.*.linear_qkv"``).
        lora_A_init_method: "xavier" or "normal" (``B`` starts at zero: the first step runs the base model).
        seed: seed of the adapters' initial values (None: the module's seed).
    """

    def __init__(
        self,
        dim: int = 32,
        alpha: float = 32.0,
        dropout: float = 0.0,
        dropout_position: Literal["pre", "post"] = "pre",
        target_modules: Sequence[str] = (ALL_LINEAR,),
        lora_A_init_method: Literal["xavier", "normal"] = "xavier",
        seed: Optional[int] = None,
    ) -> None:
        self.config = LoRAConfig(
            dim=dim,
            alpha=alpha,
            dropout=dropout,
            dropout_position=dropout_position,
            target_modules=list(target_modules),
            lora_A_init_method=lora_A_init_method,
        )
        self.seed = seed
        self.extension = LoRAExtension(self.config, seed)

    def check_before_launch(self, run: RunSpec, trainer: "pl.Trainer", module: Any, datamodule: Any) -> None:
        """MegatronStrategy's pre-launch check: the targets exist in the module's model, the layout composes."""
        config = getattr(module, "config", None)
        from megatron_lite.core.models import GPTConfig

        if not isinstance(config, GPTConfig):
            raise TypeError(f"LoRA adapts a megatron_lite.GPTModule's model, got {type(module).__name__}")
        check_targets(self.config, config)
        source = getattr(module, "pretrained_source", None)
        if source is not None:
            source.source()  # hashed here, once: ranks forked or spawned from this process inherit the hash
        existing = lora_recipe(getattr(module, "model", None))
        if existing is not None and existing[0] != self.config:
            raise ValueError(
                f"the module's model carries LoRA adapters of another configuration ({existing[0]}) than this "
                f"callback's ({self.config}): drop the callback to keep training those, or merge them first "
                f"(megatron_lite.core.peft.merge_lora(module.model))"
            )

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        add_extension(pl_module, self.extension, "LoRA")


class LoRAExtension(ObjectiveExtension):
    """Adds the adapters to each built model (before its optimizer, and before FSDP2 shards it) and freezes the rest;
    the objective is unchanged."""

    attach_before_sharding = True

    def __init__(self, config: LoRAConfig, seed: Optional[int] = None) -> None:
        self.config, self.seed = config, seed

    def attach(self, module: Any, model: Any, layout: Any) -> None:
        seed = self.seed if self.seed is not None else module.seed
        existing = lora_recipe(model)
        if existing is not None and existing[0] != self.config:
            raise ValueError(
                f"the model carries LoRA adapters of another configuration ({existing[0]}) than the LoRA callback's "
                f"({self.config})"
            )
        apply_lora(model, self.config, layout, existing[1] if existing is not None else seed)

"""Distill: train a GPTModule against a frozen teacher (knowledge distillation), as a Lightning callback.

The callback only adds a :class:`~megatron_lite.post_training.distillation.Distillation` objective extension
to the module in ``setup``: the module's own training step, schedules (TP, PP, CP, DP) and optimizer run the
distillation loss; the teacher never enters the optimizer or the checkpoint. Checkpoints saved during ``fit``
hold the intermediate-layer projections (a resumed run needs the same ``Distill``); at the end of training the
extension is removed and the student is a plain GPTModel again.
"""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import lightning.pytorch as pl

from megatron_lite.core.object_store import is_remote
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.module import GPTModule
from megatron_lite.post_training.distillation import Distillation, DistillationConfig
from megatron_lite.utils.local_path import require_local_or_object_path

TeacherSource = Union[str, Path, Any]  # a checkpoint or HF directory, a GPTModule, or "self"


def load_teacher(teacher: TeacherSource) -> Any:
    """The teacher as a GPTModule holding its weights, or ``"self"`` (a copy of the student, frozen)."""
    if isinstance(teacher, str) and teacher == "self":
        return "self"
    if isinstance(teacher, GPTModule):
        if teacher.model is None:
            raise ValueError(
                "the teacher GPTModule holds no weights yet: train it first or load it with "
                "GPTModule.from_pretrained(path)"
            )
        return teacher
    if isinstance(teacher, (str, Path)):
        require_local_or_object_path(teacher, "Distill(teacher=...)")
        if not is_remote(teacher) and not Path(teacher).exists():  # at a URL from_pretrained names what is missing
            raise FileNotFoundError(
                f"teacher {str(teacher)!r} does not exist: pass one of our checkpoints, a "
                f"Hugging Face model directory, a GPTModule or 'self'"
            )
        return GPTModule.from_pretrained(str(teacher))
    raise TypeError(
        f"teacher must be a checkpoint/HF directory path, a GPTModule or 'self', got {type(teacher).__name__}"
    )


class Distill(pl.Callback):
    """Knowledge distillation of the trained module from ``teacher``.

    Args:
        teacher: one of our checkpoints or a Hugging Face model directory, local or at an ``s3://`` URL (loaded
            once, in the launching process), a :class:`~megatron_lite.GPTModule` holding weights, or ``"self"``: a
            frozen copy of the student taken before any other extension (e.g. ``Quantize``) changes it --
            quantization-aware distillation, the unquantized model teaching its fake-quantized self.
        temperature, kd_loss_scale, skip_lm_loss, intermediate_layer_pairs, intermediate_loss,
        intermediate_loss_scale: see :class:`~megatron_lite.post_training.distillation.DistillationConfig`.

    Logs ``train/lm_loss``, ``train/kd_loss`` (and ``train/intermediate_loss``) beside ``train/loss``.
    """

    def __init__(
        self,
        teacher: TeacherSource,
        temperature: float = 1.0,
        kd_loss_scale: float = 1.0,
        skip_lm_loss: bool = False,
        intermediate_layer_pairs: Sequence[tuple[str, str]] = (),
        intermediate_loss: Literal["cosine", "mse"] = "cosine",
        intermediate_loss_scale: float = 1.0,
    ) -> None:
        self.config = DistillationConfig(
            temperature=temperature,
            kd_loss_scale=kd_loss_scale,
            skip_lm_loss=skip_lm_loss,
            intermediate_layer_pairs=list(intermediate_layer_pairs),
            intermediate_loss=intermediate_loss,
            intermediate_loss_scale=intermediate_loss_scale,
        )
        self.teacher = load_teacher(teacher)
        self.extension: Optional[Distillation] = None
        """The extension added to the module (after ``setup``)."""

    def check_before_launch(self, run: RunSpec, trainer: "pl.Trainer", module: Any, datamodule: Any) -> None:
        """MegatronStrategy's pre-launch check: before any rank starts, and in every rank before its setup."""
        config = _student_config(module)
        parallel = run.parallel
        Distillation(self.teacher, self.config).check(
            config, parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size
        )
        if isinstance(self.teacher, str) and run.use_torch_fsdp2:
            raise ValueError(
                "Distill(teacher='self') with use_torch_fsdp2=True: the student is FSDP-sharded before "
                "the copy could be taken; save the student (ModelCheckpoint) and pass its checkpoint "
                "as the teacher, or use the distributed optimizer instead of FSDP2"
            )

    def setup(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule", stage: str) -> None:
        if stage != "fit" or self.extension is not None and self.extension in pl_module.objective_extensions:
            return
        _student_config(pl_module)
        teacher = self.teacher
        if teacher == "self" and pl_module.model is not None:
            if pl_module.objective_extensions:
                raise ValueError(
                    f"Distill(teacher='self') must copy the student before other extensions change it, but "
                    f"{[type(e).__name__ for e in pl_module.objective_extensions]} came first: list Distill before "
                    f"them in Trainer(callbacks=[...])"
                )
            teacher = _Snapshot(pl_module)  # the weights as they are now, before e.g. Quantize attaches
        self.extension = Distillation(teacher, self.config)
        # First in the list: it attaches (copies a 'self' teacher) before any other extension changes the model.
        pl_module.objective_extensions.insert(0, self.extension)
        pl_module.add_objective_extension(self.extension)

    def on_train_end(self, trainer: "pl.Trainer", pl_module: "pl.LightningModule") -> None:
        # The trained student is an ordinary GPTModel again (its weights hand back to the launching process,
        # export and load like any other); the projections stay readable on the extension.
        if self.extension is not None:
            self.extension.detach(pl_module)


class _Snapshot:
    """A frozen copy of a module's current model, in the shape :class:`Distillation` takes a teacher module."""

    def __init__(self, module: Any) -> None:
        self.model = copy.deepcopy(module.model)
        self.config, self.seed = module.config, module.seed


def _student_config(module: Any):
    config = getattr(module, "config", None)
    if not hasattr(module, "add_objective_extension") or config is None:
        raise TypeError(f"Distill trains a megatron_lite.GPTModule (or a subclass), got {type(module).__name__}")
    return config

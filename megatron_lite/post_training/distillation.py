"""Knowledge distillation as an objective extension: a frozen teacher's logits (and optionally hidden
states) added to the student's loss, through the one training step of the engine.

Per token the logits term is ``T²·KL(softmax(t/T) ‖ softmax(s/T))`` over the full vocabulary split across
TP (:func:`~megatron_lite.core.parallel.vocab_parallel_kl.vocab_parallel_kl_divergence`); the loss is
``lm_loss + kd_loss_scale·kd (+ intermediate_loss_scale·intermediate)`` per loss token, or without
``lm_loss`` under ``skip_lm_loss``. The teacher is built for the student's layout (the same TP shards, the
same pipeline stages) and runs beside it: under pipeline parallelism each stage runs its teacher layers too
and sends the teacher's activations to the next stage inside the student's (concatenated along the hidden
dimension), so the last stage holds both models' logits. It is held by the extension, not the model: it is
in neither the optimizer nor the student's checkpoint. Evaluation (``val/loss``) is the student's own loss.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import torch
import torch.nn.functional as F
from torch import nn

from megatron_lite.core.checkpoint.full.state import carry_over_state, same_layout
from megatron_lite.core.engine.extensions import ForwardStep, LossFn, ObjectiveExtension
from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.loss_report import report_entry, split_loss, with_report
from megatron_lite.core.parallel.mappings import gather_from_sequence_parallel_region
from megatron_lite.core.parallel.schedules import masked_token_loss
from megatron_lite.core.parallel.vocab_parallel_kl import vocab_parallel_kl_divergence

INTERMEDIATE_LOSSES = ("cosine", "mse")


@dataclass
class DistillationConfig:
    """How the teacher's outputs enter the student's loss."""

    temperature: float = 1.0
    """Softmax temperature T of both models' logits in the KL (the KL is multiplied by T²)."""
    kd_loss_scale: float = 1.0
    """Weight of the logits KL term in the loss."""
    skip_lm_loss: bool = False
    """Train on the distillation terms alone (the student's own next-token loss is still logged)."""
    intermediate_layer_pairs: list[tuple[str, str]] = field(default_factory=list)
    """(student module, teacher module) whose outputs are matched, e.g. ("layers.1", "layers.3"); Megatron's
    "decoder.layers.N" and "decoder.final_layernorm" are accepted too."""
    intermediate_loss: Literal["cosine", "mse"] = "cosine"
    """Per-token distance of a pair's hidden states: 1 − cosine similarity, or the mean squared error."""
    intermediate_loss_scale: float = 1.0
    """Weight of the summed intermediate-layer terms in the loss."""

    def __post_init__(self) -> None:
        if not (_number(self.temperature) and self.temperature > 0):
            raise ValueError(f"temperature must be a finite number > 0, got {self.temperature!r}")
        for name in ("kd_loss_scale", "intermediate_loss_scale"):
            value = getattr(self, name)
            if not (_number(value) and value >= 0):
                raise ValueError(f"{name} must be a finite number >= 0, got {value!r}")
        if self.intermediate_loss not in INTERMEDIATE_LOSSES:
            raise ValueError(f"intermediate_loss must be one of {INTERMEDIATE_LOSSES}, got {self.intermediate_loss!r}")
        pairs = []
        for pair in self.intermediate_layer_pairs:
            if not (isinstance(pair, (tuple, list)) and len(pair) == 2 and all(isinstance(n, str) for n in pair)):
                raise ValueError(
                    f"intermediate_layer_pairs holds (student_module, teacher_module) name pairs, "
                    f"e.g. [('layers.1', 'layers.3')]; got {pair!r}"
                )
            pairs.append((_our_name(pair[0]), _our_name(pair[1])))
        self.intermediate_layer_pairs = pairs
        if self.skip_lm_loss and self.kd_loss_scale == 0 and not pairs:
            raise ValueError(
                "skip_lm_loss=True with kd_loss_scale=0 and no intermediate_layer_pairs leaves nothing "
                "to train on: raise kd_loss_scale or keep the LM loss"
            )


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _our_name(name: str) -> str:
    """Megatron-LM names its transformer block ``decoder``; ours are the GPTModel's attributes."""
    return name[len("decoder.") :] if name.startswith("decoder.") else name


def matchable_modules(config: GPTConfig) -> list[str]:
    """Names of the modules whose outputs (hidden states ``[s, b, h]``) intermediate pairs can match."""
    return [f"layers.{i}" for i in range(config.num_layers)] + ["final_layernorm"]


@dataclass
class _DistillOutput:
    """The last stage's output: the wrapped objective's, and the per-token distillation terms [b, s]."""

    inner: Any
    kd: torch.Tensor
    intermediate: Optional[torch.Tensor]


class Distillation(ObjectiveExtension):
    """Adds a frozen teacher's logits KL (and intermediate-layer losses) to a GPT module's objective.

    ``teacher`` is what :func:`megatron_lite.callbacks.distill.load_teacher` returns. Its loss reports, per training
    step (global-batch means over the loss tokens, logged on every rank): ``train/lm_loss``, ``train/kd_loss`` and,
    with layer pairs, ``train/intermediate_loss``; ``train/loss`` is their weighted sum.
    """

    def __init__(self, teacher: Any, config: DistillationConfig) -> None:
        self.source = teacher
        self.config = config
        self.teacher: Optional[GPTModel] = None
        self.student: Optional[nn.Module] = None
        self.layout: Optional[ParallelLayout] = None
        self.projections: Optional[nn.ModuleList] = None

    # --- checks and the teacher ----------------------------------------------------------------
    def teacher_config(self, student_config: GPTConfig) -> GPTConfig:
        return student_config if isinstance(self.source, str) else self.source.config

    def check(self, student_config: GPTConfig, tp: int = 1, pp: int = 1) -> None:
        """Bad input, before the models are built (and before ranks start, from the callback's
        ``check_before_launch``): vocabulary, layer names, layouts it cannot run."""
        teacher = self.teacher_config(student_config)
        if teacher.vocab_size != student_config.vocab_size:
            raise ValueError(
                f"the teacher's vocabulary ({teacher.vocab_size} tokens) differs from the student's "
                f"({student_config.vocab_size}): distillation compares their next-token distributions "
                f"token by token, so both must use the same tokenizer and vocab_size"
            )
        if teacher.padded_vocab_size(tp) != student_config.padded_vocab_size(tp):
            raise ValueError(
                f"the teacher pads its vocabulary to {teacher.padded_vocab_size(tp)} rows at TP{tp}, the "
                f"student to {student_config.padded_vocab_size(tp)}: set the student's "
                f"make_vocab_size_divisible_by={teacher.make_vocab_size_divisible_by} like the teacher's"
            )
        for student_name, teacher_name in self.config.intermediate_layer_pairs:
            for who, name, config in (("student", student_name, student_config), ("teacher", teacher_name, teacher)):
                valid = matchable_modules(config)
                if name not in valid:
                    raise ValueError(
                        f"intermediate layer {name!r} is not a module of the {who} "
                        f"({config.num_layers} layers); valid names: {', '.join(valid)}"
                    )
        if self.config.intermediate_layer_pairs and pp > 1:
            raise ValueError(
                "intermediate_layer_pairs under pipeline parallelism is not supported (a pair's layers "
                "may sit on different stages): use pipeline_model_parallel_size=1, or logits "
                "distillation alone (no intermediate_layer_pairs)"
            )

    def attach(self, module: Any, model: nn.Module, layout: ParallelLayout) -> None:
        self.check(module.config, layout.tp_size, layout.pp_size)
        self.student, self.layout = model, layout
        if isinstance(self.source, str):  # "self": the student as it is now (before e.g. quantization attaches)
            teacher = copy.deepcopy(model)
        else:
            source = self.source.model
            config = dataclasses.replace(self.source.config, hidden_dropout=0.0, attention_dropout=0.0)
            if same_layout(getattr(source, "layout", None), layout):
                teacher = source
            else:  # each rank cuts its shards (and pipeline stages) out of the one-process teacher
                teacher = GPTModel(config, layout, seed=self.source.seed)
                carry_over_state(source, teacher, vocab_size=config.vocab_size)
        # The student's device and dtype (bf16-true students): under PP both models' activations share one tensor.
        reference = next(p for p in model.parameters() if p.is_floating_point())
        if any(
            p.dtype != reference.dtype or p.device != reference.device for p in teacher.parameters()
        ) and teacher is getattr(self.source, "model", None):
            teacher = copy.deepcopy(teacher)  # the user's teacher module keeps its own dtype and device
        self.teacher = teacher.to(device=reference.device, dtype=reference.dtype).eval().requires_grad_(False)
        self._add_projections(module, model)

    def _add_projections(self, module: Any, model: nn.Module) -> None:
        """A trainable linear map student width -> teacher width per pair whose widths differ (part of the
        student's parameters: the optimizer trains it); drawn from the module's seed, equal on every rank."""
        student_width, teacher_width = module.config.hidden_size, self.teacher.config.hidden_size
        if student_width == teacher_width or not self.config.intermediate_layer_pairs:
            return
        generator = torch.Generator().manual_seed(module.seed + 15)
        projections = nn.ModuleList()
        for _ in self.config.intermediate_layer_pairs:
            linear = nn.Linear(student_width, teacher_width, bias=False)
            with torch.no_grad():
                bound = 1.0 / math.sqrt(student_width)
                linear.weight.copy_(torch.empty_like(linear.weight).uniform_(-bound, bound, generator=generator))
            projections.append(linear)
        reference = next(self.teacher.parameters())  # already on the student's device, in its dtype
        model.distill_projections = projections.to(device=reference.device, dtype=reference.dtype)

    def detach(self, module: Any) -> None:
        """Take the extension off ``module`` after training: its model loses the projections (kept here as
        ``self.projections``) and the module's objective is its own again."""
        model = module.model
        if model is not None and hasattr(model, "distill_projections"):
            self.projections = model.distill_projections
            del model.distill_projections
        if self in module.objective_extensions:
            module.objective_extensions.remove(self)

    # --- the objective ------------------------------------------------------------------------
    def forward_step(
        self, inner: ForwardStep, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]
    ) -> Any:
        if self.teacher is None or not self.student.training:  # evaluation: the student's own objective
            return inner(part, microbatch, input_tensor)
        width = self.student.config.hidden_size
        student_in = teacher_in = None
        if input_tensor is not None:  # a later pipeline stage: the teacher's activations ride behind the student's
            student_in, teacher_in = input_tensor[..., :width].contiguous(), input_tensor[..., width:].contiguous()
        captured: dict[str, torch.Tensor] = {}
        hooks = self._capture(self.student, captured, "student", part.post_process)
        try:
            out = inner(part, microbatch, student_in)
        finally:
            for hook in hooks:
                hook.remove()
        with torch.no_grad():
            hooks = self._capture(self.teacher, captured, "teacher", False)
            try:
                teacher_out = self._teacher_forward(part, microbatch, teacher_in)
            finally:
                for hook in hooks:
                    hook.remove()
        if not part.post_process:
            return torch.cat([out, teacher_out], dim=-1)
        if "logits" not in captured:
            raise RuntimeError("the student's last stage ran no output layer: distillation needs its logits")
        kd = vocab_parallel_kl_divergence(
            captured["logits"].transpose(0, 1),
            teacher_out,
            self.layout.group("tp"),
            self.student.vocab_start,
            self.student.config.vocab_size,
            self.config.temperature,
        )
        return _DistillOutput(out, kd, self._intermediate(captured))

    def _capture(self, model: nn.Module, into: dict, who: str, logits: bool) -> list:
        """Forward hooks that keep the outputs this step needs: the student's logits and each pair's module."""

        def keep(key: str):
            return lambda _module, _args, output: into.__setitem__(key, output)

        hooks = []
        if logits:
            hooks.append(model.output_layer.register_forward_hook(keep("logits")))
        side = 0 if who == "student" else 1
        for index, pair in enumerate(self.config.intermediate_layer_pairs):
            hooks.append(model.get_submodule(pair[side]).register_forward_hook(keep(f"{who}{index}")))
        return hooks

    def _teacher_forward(self, part: Any, microbatch: dict, hidden_states: Optional[torch.Tensor]) -> torch.Tensor:
        """The teacher's chunk matching ``part``: its activations, or on the last stage its logits [b, s, V/tp]."""
        tokens = microbatch["tokens"]
        inputs = tokens if "labels" in microbatch else tokens[:, :-1]
        index = getattr(part, "index", None)  # a pipeline chunk; None: the whole model
        run = self.teacher.chunks[index] if index is not None else self.teacher
        kwargs = dict(position_ids=microbatch.get("position_ids"), cu_seqlens=microbatch.get("cu_seqlens"))
        if hidden_states is not None:
            kwargs["hidden_states"] = hidden_states
        return run(inputs, None, **kwargs)

    def _intermediate(self, captured: dict) -> Optional[torch.Tensor]:
        """Sum over the layer pairs of the per-token distance [b, s] of the student's (projected) and the
        teacher's hidden states; sequence-parallel shards are gathered first (each TP rank then computes the
        whole sequence's loss, so the gather's backward only splits)."""
        pairs = self.config.intermediate_layer_pairs
        if not pairs:
            return None
        group = self.layout.group("tp") if self.student.sequence_parallel else None
        projections = getattr(self.student, "distill_projections", None)
        total = None
        for index in range(len(pairs)):
            student, teacher = captured[f"student{index}"], captured[f"teacher{index}"]
            if group is not None:
                student = gather_from_sequence_parallel_region(student, group, grad_is_partial=False)
                teacher = gather_from_sequence_parallel_region(teacher, group, grad_is_partial=False)
            if projections is not None:
                student = projections[index](student)
            student, teacher = student.float(), teacher.float()
            if self.config.intermediate_loss == "cosine":
                distance = 1.0 - F.cosine_similarity(student, teacher, dim=-1)
            else:
                distance = (student - teacher).pow(2).mean(dim=-1)
            total = distance if total is None else total + distance
        return total.transpose(0, 1)  # [s, b] -> [b, s], like the loss mask

    def loss(self, inner: LossFn, output: Any, microbatch: dict) -> tuple:
        if not isinstance(output, _DistillOutput):
            return inner(output, microbatch)
        lm, count, report = split_loss(inner(output.inner, microbatch))
        kd, _ = masked_token_loss(output.kd, microbatch)
        total = kd * self.config.kd_loss_scale if self.config.skip_lm_loss else lm + kd * self.config.kd_loss_scale
        parts = {"lm_loss": report_entry(lm, count), "kd_loss": report_entry(kd, count)}
        if output.intermediate is not None:
            intermediate, _ = masked_token_loss(output.intermediate, microbatch)
            total = total + intermediate * self.config.intermediate_loss_scale
            parts["intermediate_loss"] = report_entry(intermediate, count)
        return with_report((total, count, report), **parts)

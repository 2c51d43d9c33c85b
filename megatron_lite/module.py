"""GPTModule: the thin LightningModule around the core GPT model and the training engine.

One Lightning batch is one optimizer step's worth of samples for this data-parallel rank. The
engine (``megatron_lite.core.engine``) runs the schedule (no pipelining, or a pipeline schedule that
does the backward passes), reduces gradients, clips the global norm and steps the optimizer; the
module supplies only the model, a stage forward and the loss. That is why the module uses
Lightning's manual optimization: Lightning must not run a second backward. Its inference entry points
(``full_logits``, ``generate``, ``generate_batch``) are ``module_inference.py``'s.
"""

from __future__ import annotations

import dataclasses
import re
import warnings
from typing import Any, Optional

import lightning.pytorch as pl
import torch
from torch import nn
from torchmetrics.aggregation import MeanMetric

from megatron_lite.core.checkpoint.fingerprint import LoadedWeights
from megatron_lite.core.checkpoint.full.state import carry_over_state, load_full_state, same_layout
from megatron_lite.core.checkpoint.resume.entries import QUANTIZATION_RECIPE
from megatron_lite.core.engine import TrainingEngine
from megatron_lite.core.engine.extensions import ExtendedObjective, ObjectiveExtension
from megatron_lite.core.estimator.objective_cost import ObjectiveCost
from megatron_lite.core.models import GPTConfig, GPTModel
from megatron_lite.core.optim import MegatronLRScheduler, OptimizerConfig
from megatron_lite.core.optim.distributed import DistributedOptimizer
from megatron_lite.core.optim.optimizer import MegatronOptimizer, StepResult
from megatron_lite.core.parallel.context_parallel import context_parallel_microbatch
from megatron_lite.core.parallel.fsdp import apply_fsdp2
from megatron_lite.core.parallel.geometry import declared_geometry
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.core.parallel.schedules import (
    StepLoss,
    gpt_forward_step,
    gpt_loss,
    masked_token_loss,
    split_microbatches,
)
from megatron_lite.core.peft import carry_adapters, has_adapters, restore_lora
from megatron_lite.core.timers import Timers
from megatron_lite.module_checks import check_module_run
from megatron_lite.module_inference import GPTInference
from megatron_lite.pretrained import load_pretrained, tokenizer_metadata
from megatron_lite.tokenizers.build import TOKENIZER_KEY  # noqa: F401  (its old place: megatron_lite.module)
from megatron_lite.utils.local_path import require_local_or_object_path

_DEFAULT_OPTIMIZER = OptimizerConfig()
_POST_STEP_CHECKPOINT_WARNING = (
    "Using ModelCheckpoint with manual optimization and every_n_train_steps, but no pre-optimization state was saved."
)


def _host_value(value: float) -> torch.Tensor:
    """A host number to log, as a host tensor: Lightning would copy a Python number to the module's device."""
    return torch.tensor(float(value), dtype=torch.float32)


class GPTModule(GPTInference, pl.LightningModule):
    """Train a :class:`GPTModel` under any layout of :class:`MegatronStrategy` (or alone).

    The engine calls :meth:`forward_step` on each model chunk and :meth:`loss` on the last stage's
    output; override those (they work under pipeline parallelism) or, without pipelining, the
    one-call :meth:`loss_fn`; :meth:`build_model` changes the model.
    """

    progress_bar_metrics: tuple[str, ...] = ()
    """Names of the loss's reported metrics (see :meth:`loss`) that are also shown on the progress bar."""

    loss_is_token_nll = True
    """The loss is a mean next-token negative log-likelihood, so ``exp(val/loss)`` is a perplexity (the metrics
    callback logs ``val/perplexity`` only then); objectives with another loss (DPO, reward models) set False."""

    def __init__(
        self,
        config: GPTConfig,
        optimizer: OptimizerConfig = _DEFAULT_OPTIMIZER,
        seed: int = 1234,
        strict_loading: bool = True,
    ):
        """``strict_loading``: Lightning's ``LightningModule.strict_loading`` (settable here for the CLI,
        ``--model.strict_loading false``): a checkpoint given as ``ckpt_path`` must hold exactly this module's
        tensors (missing and unexpected ones are refused by name), unless False: then the tensors both have
        are loaded and the others keep their values."""
        super().__init__()
        self.strict_loading = strict_loading
        if not isinstance(config, GPTConfig):
            raise TypeError(f"config must be a megatron_lite.GPTConfig, got {type(config).__name__}")
        # Copies: the optimizer default is a shared instance, and a module must own its configs.
        self.config = dataclasses.replace(config)
        self.optimizer_config = dataclasses.replace(optimizer if optimizer is not None else OptimizerConfig())
        self.seed = seed
        self.save_hyperparameters({"config": self.config, "optimizer": self.optimizer_config, "seed": seed})
        self.automatic_optimization = False
        self.model: Optional[nn.Module] = None
        self.megatron_optimizer: Optional[MegatronOptimizer] = None
        self._engine: Optional[TrainingEngine] = None
        self.pretrained_source: Optional[LoadedWeights] = None
        """Where the model's weights came from (``from_pretrained``: the path, hashed when a LoRA run first needs it),
        while its base has not been trained since: a LoRA run's checkpoints then hold only the adapters and name this
        base."""
        self.objective_extensions: list[ObjectiveExtension] = []
        """Changes to the objective (distillation, draft heads, ...), see :meth:`add_objective_extension`."""
        self._attached: list[tuple[ObjectiveExtension, int]] = []  # (extension, id of the model it attached to)
        self.val_loss_metric = MeanMetric()
        self.test_loss_metric = MeanMetric()
        self.report_metrics = nn.ModuleDict()
        """The epoch means of the metrics the loss reports in evaluation, made at their first batch."""

    @classmethod
    def from_pretrained(
        cls,
        path: str,
        *,
        optimizer: Optional[OptimizerConfig] = None,
        seed: Optional[int] = None,
        strict: bool = True,
        adapter: Optional[str] = None,
        base: Optional[str] = None,
        **config_overrides: Any,
    ) -> "GPTModule":
        """A module holding the weights of ``path``: a Hugging Face Llama/Mistral/Qwen2/Qwen3 directory
        (config.json + safetensors) or one of our checkpoints (its saved config, optimizer settings and seed), local
        or at an ``s3://`` URL (docs/object-storage.md: our checkpoint's tensors are read from the store, a Hugging
        Face directory from a cached local copy).

        The model is built for one process and put in eval mode: ``module.full_logits(tokens)`` and
        ``module.generate(...)`` work at once, without a Trainer; ``trainer.fit/validate/predict(module, ...)``
        under any layout cuts each rank's shards out of it. ``config_overrides`` replace GPTConfig fields that
        do not change a weight's shape (``seq_length``, dropout, recomputation, ...); ``optimizer`` and ``seed``
        replace the saved ones (an HF model gets ``OptimizerConfig()`` and 1234). The checkpoint must hold exactly the
        model's tensors (missing and unexpected ones are refused by name) unless ``strict=False``, which loads the
        ones both have and leaves the others at their initial values.

        ``adapter``: a Hugging Face PEFT LoRA adapter directory (``adapter_config.json`` +
        ``adapter_model.safetensors``) trained on this base, put on the model exactly
        (:mod:`megatron_lite.core.checkpoint.hf.peft`): the module computes PEFT's logits, and a ``fit`` trains the
        adapters with the base frozen, as after the ``LoRA`` callback.

        A LoRA run's adapter-only checkpoint gives the adapted model: its base is loaded from where the checkpoint
        records it (or from ``base``, if it moved), checked against the recorded content hash, then the adapters.
        """
        require_local_or_object_path(path, "GPTModule.from_pretrained path")
        require_local_or_object_path(adapter, "adapter")
        require_local_or_object_path(base, "base")
        return load_pretrained(
            cls, path, optimizer=optimizer, seed=seed, strict=strict, adapter=adapter, base=base, **config_overrides
        )

    # --- layout and model -----------------------------------------------------------------
    def _attached_trainer(self) -> Optional["pl.Trainer"]:
        try:
            return self.trainer
        except RuntimeError:  # not attached to a Trainer
            return None

    @property
    def parallel_layout(self) -> ParallelLayout:
        """The strategy's layout, or a one-process layout when running alone without MegatronStrategy."""
        trainer = self._attached_trainer()
        layout = getattr(trainer.strategy, "parallel_layout", None) if trainer is not None else None
        if layout is not None:
            return layout
        if trainer is not None and trainer.world_size > 1:
            raise ValueError(
                f"GPTModule runs its own microbatch schedule and gradient reduction, which need "
                f"MegatronStrategy for more than one process (got {type(trainer.strategy).__name__} with "
                f"{trainer.world_size} processes); use Trainer(strategy='megatron')."
            )
        return ParallelLayout.single()

    def build_model(self, layout: ParallelLayout) -> nn.Module:
        """The model for this rank (its pipeline stages' layers only); called once from :meth:`configure_model`."""
        return GPTModel(self.config, layout, seed=self.seed)

    @property
    def engine(self) -> TrainingEngine:
        """The engine that runs this module's steps (rebuilt when the model or optimizer changes)."""
        if self.model is None:
            raise RuntimeError("the model is not built yet: the Trainer calls configure_model() first")
        engine = self._engine
        extensions = tuple(self.objective_extensions)
        if engine is None or engine.model is not self.model or getattr(engine, "extensions", ()) != extensions:
            objective = ExtendedObjective(self, extensions) if extensions else self
            engine = self._engine = TrainingEngine(self.model, self.parallel_layout, objective)
            engine.extensions = extensions
        engine.optimizer = self.megatron_optimizer
        engine.timers = self.run_timers()
        return engine

    def add_objective_extension(self, extension: ObjectiveExtension) -> None:
        """Wrap this module's objective (forward_step and loss) with ``extension`` for every later step; the
        first extension added is the outermost. Its ``attach`` runs once the model is built (at once if it is).
        Callbacks (``Distill``, ``Quantize``, draft-head training) call this from their ``setup``."""
        if not isinstance(extension, ObjectiveExtension):
            raise TypeError(f"{type(extension).__name__} is not an ObjectiveExtension")
        if extension not in self.objective_extensions:
            self.objective_extensions.append(extension)
        if self.model is not None:
            self._attach_extensions()

    def _attach_extensions(self, before_sharding: bool = False) -> None:
        """Attach every extension not attached to the current model yet (``before_sharding``: only those whose
        ``attach_before_sharding`` says they add parameters FSDP2 must shard with the model's)."""
        for extension in self.objective_extensions:
            if before_sharding and not extension.attach_before_sharding:
                continue
            if (extension, id(self.model)) not in self._attached:
                extension.attach(self, self.model, self.parallel_layout)
                self._attached.append((extension, id(self.model)))

    def configure_model(self) -> None:
        layout = self.parallel_layout
        built_for = getattr(self.model, "layout", None)  # None: a model of unknown layout, kept as it is
        if self.model is not None and (built_for is None or same_layout(built_for, layout)):
            self._attach_extensions()
            return
        self._check_vocab(getattr(self._attached_trainer(), "datamodule", None))
        previous, self.model = self.model, self.build_model(layout)
        if previous is not None:
            carry_adapters(previous, self.model, layout)
        if self._fsdp():
            # parameters added by extensions (LoRA's adapters) must exist before FSDP2 takes the model's in
            self._attach_extensions(before_sharding=True)
            apply_fsdp2(self.model, layout)
        if previous is not None:
            # Built for another layout: the one-process model a forked fit handed back to the notebook, or
            # the previous run's in this process. Each rank cuts its shard of the weights out of it.
            carry_over_state(previous, self.model, vocab_size=self.config.vocab_size)
        self._attach_extensions()

    def load_full_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Load full global tensors keyed like this module's parameters (``model.…``) into the model,
        built first for one process if there is none: how a forked fit hands the trained model back to
        the notebook that launched it (MegatronStrategy calls this there). What objective extensions added to
        the ranks' model -- those a callback added in its ``setup``, which ran in the ranks only -- is rebuilt
        here from ``state`` (quantizers, a draft head), so the module ends with their trained values too."""
        if self.model is None:
            self.model = self.build_model(ParallelLayout.single())
            for extension in self.objective_extensions:  # their sub-modules (a draft head) are in `state` too
                extension.attach(self, self.model, ParallelLayout.single())
                self._attached.append((extension, id(self.model)))
        if f"model.{QUANTIZATION_RECIPE}" in state:  # the ranks quantized it: quantizers first, then their tensors
            from megatron_lite.post_training.quantization import restore_from_state

            restore_from_state(self.model, state, prefix="model.")
        if not restore_lora(self.model, state, ParallelLayout.single(), prefix="model.") and not has_adapters(
            self.model
        ):
            self.pretrained_source = None  # the ranks trained the base itself: it is no longer the recorded one
        from megatron_lite.post_training.speculative import restore_draft_head  # here: the package import stays light

        restore_draft_head(self.model, state, prefix="model.")
        load_full_state(self, state, vocab_size=self.config.vocab_size)

    def _fsdp(self) -> bool:
        run = self._run_spec()
        return run is not None and run.shards_with_fsdp2

    def _run_spec(self) -> Optional[RunSpec]:
        """The run's description under MegatronStrategy (None alone or under another strategy)."""
        trainer = self._attached_trainer()
        run = getattr(trainer.strategy, "run_spec", None) if trainer is not None else None
        return run if isinstance(run, RunSpec) else None

    def run_timers(self) -> Optional[Timers]:
        """The run's Megatron timers (held by the MegatronMetrics callback), if any."""
        trainer = self._attached_trainer()
        callbacks = trainer.callbacks if trainer is not None else []
        return next((c.timers for c in callbacks if isinstance(getattr(c, "timers", None), Timers)), None)

    def _precision(self) -> str:
        trainer = self._attached_trainer()
        return str(trainer.precision) if trainer is not None else "32-true"

    def _check_vocab(self, datamodule) -> None:
        data_vocab = getattr(datamodule, "vocab_size", None)
        if isinstance(data_vocab, int) and data_vocab > self.config.vocab_size:
            raise ValueError(
                f"the data's vocabulary ({data_vocab} tokens) is larger than the model's vocab_size "
                f"({self.config.vocab_size}); set model.config.vocab_size={data_vocab}."
            )

    def forward(self, tokens: torch.Tensor, labels: Optional[torch.Tensor] = None) -> torch.Tensor:
        return self.model(tokens, labels)

    # --- the objective: a stage forward and the last stage's loss ----------------------------
    def forward_step(self, part: Any, microbatch: dict, input_tensor: Optional[torch.Tensor]) -> Any:
        """One model chunk's forward: activations for the next stage, or the per-token loss [b, s] on
        the last stage."""
        if self._overrides_loss_fn():
            return self.loss_fn(self.model, microbatch)  # the whole model in one call (no pipelining)
        return gpt_forward_step(part, microbatch, input_tensor)

    def loss(self, output: Any, microbatch: dict) -> tuple:
        """(sum of the per-token losses where ``loss_mask`` is set, their number). An override may return a
        third element, a report of metrics ``{name: report_entry(sum, count)}``: the engine reduces each with
        the loss and the module logs its global mean as ``train/<name>`` (``val/<name>`` in validation)."""
        if self._overrides_loss_fn():
            return output  # loss_fn returned (sum, count) already
        return masked_token_loss(output, microbatch)

    def loss_fn(self, model: nn.Module, microbatch: dict) -> tuple[torch.Tensor, torch.Tensor]:
        """(sum of per-token losses, number of loss tokens) of one microbatch through the whole model.
        Overriding it is the short way to change the objective without pipeline parallelism; with
        pipeline stages override :meth:`forward_step` and :meth:`loss` instead."""
        return gpt_loss(model, microbatch)

    def _overrides_loss_fn(self) -> bool:
        return type(self).loss_fn is not GPTModule.loss_fn

    def micro_batch_size(self, batch: dict) -> int:
        """Samples per microbatch: the ``micro_batch_size`` of the datamodule's geometry, else the whole batch."""
        geometry = declared_geometry(getattr(self._attached_trainer(), "datamodule", None))
        return geometry.micro_batch_size if geometry is not None else next(iter(batch.values())).shape[0]

    def step_microbatches(self, batch: dict) -> list[dict]:
        """``batch`` cut into the microbatches the engine runs; under context parallelism each is this CP
        rank's share (:meth:`context_parallel_share`). ``batch`` itself is left whole."""
        return [self.context_parallel_share(mb) for mb in split_microbatches(batch, self.micro_batch_size(batch))]

    def context_parallel_share(self, microbatch: dict) -> dict:
        """This CP rank's zigzag share of a ``{"tokens": [b, s+1], ...}`` microbatch (the microbatch itself
        without context parallelism): ``tokens`` (the inputs) and ``labels`` ``[b, s/C]``, ``loss_mask`` and
        ``position_ids`` (global positions) sliced the same way, ``cu_seqlens`` whole. Loss and token counts are
        then summed over the data x context parallel group, so the step's loss is the global-batch mean."""
        layout = self.parallel_layout
        if layout.cp_size == 1:
            return microbatch
        return context_parallel_microbatch(microbatch, layout.cp_size, layout.cp_rank)

    def run_schedule(self, batch: dict, forward_only: bool = False, **schedule_kwargs: Any) -> StepLoss:
        """Forward (and backward) over the microbatches of ``batch``; the loss is the global-batch mean."""
        return self.engine.forward_backward(self.step_microbatches(batch), forward_only=forward_only, **schedule_kwargs)

    def training_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        step, result, lr = self.engine_train_step(self.step_microbatches(batch), self._global_batch_samples(batch))
        self.log_training_step(step, result, lr)
        return step.loss

    def engine_train_step(
        self, microbatches: list[dict], global_batch_samples: int
    ) -> tuple[StepLoss, StepResult, float]:
        """One engine train step over ``microbatches`` (this rank's share of a global batch of
        ``global_batch_samples``), then the LR schedule's step, which (as Megatron's) advances only when the
        weights were updated. Returns the step's loss, the optimizer's result and the LR it ran at."""
        scheduler = self.lr_schedulers()
        lr = scheduler.current_lr  # before any per-group multiplier (a ZeRO-1 rank may hold only scaled groups)
        step, result = self.engine.train_step(microbatches, optimizer_step=self.optimizers().step)
        if not result.skipped:
            scheduler.step(increment=global_batch_samples if self.optimizer_config.sample_based else None)
        return step, result, lr

    def log_training_step(self, step: StepLoss, result: StepResult, lr: float) -> None:
        """Log a training step: ``train/loss``, ``train/lr``, ``train/grad_norm``, ``train/skipped_steps``
        (``train/loss_scale`` with fp16), every metric the loss reported as ``train/<name>`` (its global mean)
        and the objective extensions' ``step_metrics``."""
        # No host sync per step on a GPU: Lightning turns every progress-bar value into a Python number after each
        # batch (a device sync each), so values go to the bar only when one is shown; and it copies a logged Python
        # number to the module's device (a blocking copy each), so host values are logged as host tensors. The
        # logger reads the device values (loss, grad norm) once per logged step.
        bar = self._shows_progress_bar()
        self.log("train/loss", step.loss, prog_bar=bar)
        self.log("train/lr", _host_value(lr), prog_bar=bar)
        self.log("train/grad_norm", result.grad_norm)
        self.log("train/skipped_steps", _host_value(self.megatron_optimizer.skipped_steps))
        if result.loss_scale is not None:
            self.log("train/loss_scale", _host_value(result.loss_scale))
        for name, value in step.report_means().items():
            self.log(f"train/{name}", value, prog_bar=bar and name in self.progress_bar_metrics)
        for extension in self.objective_extensions:
            for name, value in extension.step_metrics().items():
                self.log(name, value)

    def _shows_progress_bar(self) -> bool:
        trainer = self._attached_trainer()
        return trainer is None or trainer.progress_bar_callback is not None

    def on_train_start(self) -> None:
        # Lightning (>= 2.2) keeps whatever mode a module is in at fit, and from_pretrained hands the model back in
        # eval mode (for generate/full_logits): trained so, dropout and every training-only objective term (e.g.
        # distillation's KL) would be silently off. Evaluation loops restore this mode after they ran.
        if self.model is not None:
            self.model.train()
        # Lightning's ModelCheckpoint(every_n_train_steps=...) warns, at every save of a manual-optimization module,
        # that the checkpoint holds the weights after the optimizer step, as if that were a surprise: this module's
        # optimizer step runs inside training_step, so those are the weights of the step saved, as with automatic
        # optimization. Exactly that warning is silenced, in the processes that train a GPTModule.
        warnings.filterwarnings("ignore", message=re.escape(_POST_STEP_CHECKPOINT_WARNING), category=UserWarning)

    def on_fit_end(self) -> None:
        # After training a backward (user code, evaluation tools) should leave its gradients in param.grad.
        if self.megatron_optimizer is not None:
            self.megatron_optimizer.remove_hooks()

    def _global_batch_samples(self, batch: dict) -> int:
        """Samples in this step's global batch (every DP rank receives the same share; the CP ranks of one
        replica share the same samples, so CP does not count)."""
        return next(iter(batch.values())).shape[0] * self.parallel_layout.dp_size

    def validation_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.evaluate_step(batch, "val")

    def test_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        return self.evaluate_step(batch, "test")

    def evaluate_step(self, batch: dict, prefix: str) -> torch.Tensor:
        step = self.run_schedule(batch, forward_only=True)
        # The epoch's loss is the mean over every loss token of the split (a token-weighted mean of
        # the batches' global means, which are the same on every rank), so its exp is the perplexity.
        metric = self.val_loss_metric if prefix == "val" else self.test_loss_metric
        metric.update(step.loss.detach(), weight=step.num_tokens.to(step.loss.dtype))
        self.log(f"{prefix}/loss", metric, prog_bar=True, on_step=False, on_epoch=True)
        self.log_evaluation_report(step, prefix)
        return step.loss

    def log_evaluation_report(self, step: StepLoss, prefix: str) -> None:
        """Log every metric the loss reported as ``{prefix}/<name>``: over the epoch, the mean of the
        batches' global means weighted by their counts (as ``{prefix}/loss`` is by its tokens)."""
        for name, mean in step.report_means().items():
            key = f"{prefix}/{name}".replace(".", "_")  # a sub-module's name holds no dot
            if key not in self.report_metrics:
                self.report_metrics[key] = MeanMetric().to(mean.device)
            metric = self.report_metrics[key]
            metric.update(mean, weight=step.report[name][1].to(mean.dtype))
            self.log(
                f"{prefix}/{name}",
                metric,
                on_step=False,
                on_epoch=True,
                prog_bar=name in self.progress_bar_metrics,
                metric_attribute=f"report_metrics.{key}",
            )

    def predict_step(self, batch: dict, batch_idx: int) -> torch.Tensor:
        """Next-token logits over the real vocabulary ``[b, s, vocab_size]`` (gathered across TP) for
        ``batch["tokens"]``; every TP rank and pipeline stage returns the same tensor. A batch of prompts
        (:class:`~megatron_lite.data.PromptDataModule`) is continued instead: see :meth:`generate_batch`."""
        if "prompt_lengths" in batch:
            return self.generate_batch(batch)
        return self.full_logits(batch["tokens"])

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        # Which tokenizer the data used, with copies of its files (the originals may sit in a cache that goes
        # away), so `megatron-lite generate` can detokenize and `convert --to hf` export it.
        checkpoint.update(
            tokenizer_metadata(getattr(getattr(self._attached_trainer(), "datamodule", None), "tokenizer", None))
        )

    def objective_cost(self, datamodule: Any = None) -> ObjectiveCost:
        """What one sample of ``datamodule`` costs per training step (FLOPs, MFU and the memory estimate count
        it): here one sequence, one forward and backward. Objectives that run more override it."""
        return ObjectiveCost()

    # --- optimizer ------------------------------------------------------------------------
    def check_before_launch(
        self,
        run: RunSpec,
        trainer: "pl.Trainer",
        module: "pl.LightningModule",
        datamodule: Optional["pl.LightningDataModule"],
    ) -> None:
        """Checks that need the Trainer, the run or the data (MegatronStrategy's pre-launch check: before it
        starts any process, and again in every rank): :func:`~megatron_lite.module_checks.check_module_run`."""
        check_module_run(self, run, trainer, datamodule)

    def configure_optimizers(self) -> Any:
        cfg = self.optimizer_config
        trainer = self._attached_trainer()
        layout = self.parallel_layout
        fp16 = self._precision().startswith("16")
        if not has_adapters(self.model):
            self.pretrained_source = None  # this fit trains the base itself: it will no longer be the recorded one
        if self.megatron_optimizer is not None:  # a second fit on this module: detach the previous one
            self.megatron_optimizer.remove_hooks()
        run = self._run_spec()
        buckets = dict(
            bucket_size=run.ddp_bucket_size if run is not None else None,
            overlap_grad_reduce=run is not None and run.overlap_grad_reduce,
        )
        if cfg.use_distributed_optimizer:
            self.megatron_optimizer = DistributedOptimizer(self.model, cfg, layout, fp16=fp16, **buckets)
        elif self._fsdp():
            self.megatron_optimizer = MegatronOptimizer(self.model, cfg, layout, fp16=fp16, grad_reduction="fsdp")
        else:
            self.megatron_optimizer = MegatronOptimizer(self.model, cfg, layout, fp16=fp16, **buckets)
        self.megatron_optimizer.timers = self.run_timers()
        optimizer = self.megatron_optimizer.optimizer
        scheduler = MegatronLRScheduler(optimizer, cfg, trainer.max_steps if trainer is not None else None)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": scheduler, "interval": "step"}}

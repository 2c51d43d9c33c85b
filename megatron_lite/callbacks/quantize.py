"""Quantize: post-training quantization at the end of fit, or quantization-aware training from its start.

``Quantize(config="INT8_SMOOTHQUANT_CFG", calib_batches=8)`` (``when="fit_end"``): after the last step every
rank calibrates on its next ``calib_batches`` training batches (ModelOpt, our layers registered; amax synchronised
over DP and TP), and the validation perplexity before and after is measured on the same batches, printed and
logged (``quant/val_ppl_before``, ``quant/val_ppl_after``, ``quant/val_ppl_ratio``) and kept in
:attr:`Quantize.metrics`. Checkpoints saved afterwards, and the model a forked fit hands back, are quantized.

``when="fit_start"``: the model is quantized (and calibrated) once it is built, before the optimizer exists (an
objective extension's ``attach``), so the whole fit trains the fake-quantized model: QAT. Fake quantization
passes gradients straight through to the weights. Resuming such a fit (``ckpt_path=``) from a quantized
checkpoint rebuilds its quantizers and loads their tensors instead of calibrating again.

A checkpoint quantized by either is loaded back quantized by ``GPTModule.from_pretrained``; a later
``trainer.fit(ckpt_path=...)`` of it needs this callback (``when="fit_start"``) so its quantizers exist before
the checkpoint is read.
"""

from __future__ import annotations

import itertools
from typing import Any, Optional

import lightning.pytorch as pl
from lightning.fabric.utilities.apply_func import move_data_to_device
from lightning.pytorch.utilities.rank_zero import rank_zero_info

from megatron_lite.core.engine.extensions import ObjectiveExtension
from megatron_lite.core.models.config import refuse_mla
from megatron_lite.core.models.moe_config import refuse_experts

_WHEN = ("fit_end", "fit_start")


class Quantize(pl.Callback):
    """Quantize the trained model with nvidia-modelopt (PTQ at ``fit_end``) or train it quantized (QAT, ``fit_start``).

    Args:
        config: a ModelOpt config name (``INT8_SMOOTHQUANT_CFG``, ``FP8_DEFAULT_CFG``, ``INT4_AWQ_CFG``,
            ``W4A8_AWQ_BETA_CFG``, ``NVFP4_DEFAULT_CFG`` (CUDA), ...); None quantizes only the KV cache.
        calib_batches: training batches each rank calibrates on.
        when: ``"fit_end"`` (post-training quantization) or ``"fit_start"`` (quantization-aware training).
        kv_cache: a ModelOpt KV-cache preset (``"FP8_KV_CFG"``) added to ``config``.
        eval_batches: validation batches for the perplexity report (None: the whole validation set; 0: none).
    """

    def __init__(
        self,
        config: Optional[str] = "INT8_SMOOTHQUANT_CFG",
        calib_batches: int = 8,
        when: str = "fit_end",
        kv_cache: Optional[str] = None,
        eval_batches: Optional[int] = None,
    ) -> None:
        from megatron_lite.post_training.quantization import needs_cuda, resolve_config

        if when not in _WHEN:
            raise ValueError(f"Quantize(when={when!r}) must be one of {_WHEN}")
        if isinstance(calib_batches, bool) or not isinstance(calib_batches, int) or calib_batches < 1:
            raise ValueError(f"Quantize(calib_batches={calib_batches!r}) must be a positive integer")
        if eval_batches is not None and (not isinstance(eval_batches, int) or eval_batches < 0):
            raise ValueError(f"Quantize(eval_batches={eval_batches!r}) must be None or a non-negative integer")
        cfg = resolve_config(config, kv_cache)  # an unknown name fails here, listing the valid ones
        import torch

        if needs_cuda(cfg) and not torch.cuda.is_available():
            raise ValueError(
                f"Quantize(config={config!r}) uses FP4/FP6 elements or MX block scales, which ModelOpt "
                f"runs only in CUDA kernels, and this machine has no GPU; pick a CPU format "
                f"(INT8_SMOOTHQUANT_CFG, FP8_DEFAULT_CFG, INT4_AWQ_CFG, W4A8_AWQ_BETA_CFG)"
            )
        self.config, self.calib_batches, self.when = config, calib_batches, when
        self.kv_cache, self.eval_batches = kv_cache, eval_batches
        self.metrics: dict[str, float] = {}
        """``val_ppl_before``, ``val_ppl_after`` and ``val_ppl_ratio`` of the last quantization (when measured)."""
        self._trainer: Optional[pl.Trainer] = None

    # --- hooks ----------------------------------------------------------------------------
    def check_before_launch(self, run: Any, trainer: pl.Trainer, module: Any, datamodule: Any) -> None:
        """Refuse, before any rank starts, a model quantization cannot cover (an MoE's experts)."""
        refuse_experts(getattr(module, "config", None), "Quantize (ModelOpt quantization)")
        refuse_mla(getattr(module, "config", None), "Quantize (ModelOpt quantization)")

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._trainer = trainer
        if stage == "fit" and self.when == "fit_start":
            pl_module.add_objective_extension(_QuantizeAtAttach(self))

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        # Not on_fit_end: by then the strategy has torn the process groups down, and calibration and the
        # perplexity need them (amax reduced over DP/TP, the loss over the global batch).
        from megatron_lite.post_training.quantization import is_quantized

        if self.when == "fit_end" and not is_quantized(pl_module.model):
            self._quantize(trainer, pl_module)
        elif self.when == "fit_start" and self.eval_batches != 0:
            after = self._perplexity(trainer, pl_module)
            if after is not None:
                self._report(trainer, {"val_ppl_after_qat": after})

    # --- the work -------------------------------------------------------------------------
    def _quantize(self, trainer: pl.Trainer, pl_module: Any) -> None:
        from megatron_lite.post_training.quantization import quantize

        before = self._perplexity(trainer, pl_module)
        quantize(
            pl_module,
            self.config,
            self._batches(trainer, pl_module, "train", self.calib_batches),
            kv_cache=self.kv_cache,
        )
        after = self._perplexity(trainer, pl_module)
        if before is not None and after is not None:
            self._report(trainer, {"val_ppl_before": before, "val_ppl_after": after, "val_ppl_ratio": after / before})

    def _restore_or_quantize(self, pl_module: Any, model: Any, layout: Any) -> None:
        from megatron_lite.post_training.quantization import read_checkpoint_quantization, restore_quantization

        trainer = self._trainer
        ckpt = getattr(trainer, "ckpt_path", None) if trainer is not None else None
        saved = _checkpoint_quantization(ckpt, read_checkpoint_quantization)
        if saved is not None:
            recipe, shapes = saved
            if (recipe["config"], recipe["kv_cache"]) != (self.config, self.kv_cache):
                raise ValueError(
                    f"the checkpoint {ckpt} was quantized with config={recipe['config']!r}, "
                    f"kv_cache={recipe['kv_cache']!r}, not Quantize(config={self.config!r}, "
                    f"kv_cache={self.kv_cache!r}); resume with the checkpoint's"
                )
            restore_quantization(model, recipe, shapes, layout)
            return
        self._quantize(trainer, pl_module)

    def _batches(self, trainer: pl.Trainer, pl_module: Any, split: str, limit: Optional[int]) -> list:
        datamodule = getattr(trainer, "datamodule", None)
        if datamodule is None:
            raise ValueError(
                "Quantize takes its calibration and evaluation batches from the datamodule: pass "
                "trainer.fit(module, datamodule=...)"
            )
        loader = datamodule.train_dataloader() if split == "train" else datamodule.val_dataloader()
        # a fresh iterator over the split: calibration reads the first batches, training's own loader is untouched
        batches = list(itertools.islice(iter(loader), limit)) if limit is not None else list(loader)
        return [move_data_to_device(b, pl_module.device) for b in batches]

    def _perplexity(self, trainer: pl.Trainer, pl_module: Any) -> Optional[float]:
        from megatron_lite.post_training.quantization import perplexity

        if self.eval_batches == 0:
            return None
        batches = self._batches(trainer, pl_module, "val", self.eval_batches)
        return perplexity(pl_module, batches) if batches else None

    def _report(self, trainer: pl.Trainer, values: dict[str, float]) -> None:
        self.metrics.update(values)
        name = self.config if self.kv_cache is None else f"{self.config} + {self.kv_cache}"
        rank_zero_info("megatron-lite Quantize(" + name + "): " + ", ".join(f"{k}={v:.4f}" for k, v in values.items()))
        for logger in trainer.loggers:
            logger.log_metrics({f"quant/{k}": v for k, v in values.items()}, step=trainer.global_step)


def _checkpoint_quantization(ckpt: Any, reader) -> Optional[tuple]:
    if ckpt is None or str(ckpt) in ("last", "hpc", "best", "registry"):
        return None  # resolved by the strategy later; a "last" resume of a QAT run recalibrates, then loads
    return reader(ckpt)


class _QuantizeAtAttach(ObjectiveExtension):
    """QAT: quantize the model as soon as it is built (before the optimizer); the objective is unchanged."""

    def __init__(self, callback: Quantize) -> None:
        self.callback = callback

    def attach(self, module: Any, model: Any, layout: Any) -> None:
        from megatron_lite.post_training.quantization import is_quantized

        if not is_quantized(model):
            self.callback._restore_or_quantize(module, model, layout)

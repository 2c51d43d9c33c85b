"""The checks a GPTModule makes of a run before any rank starts (MegatronStrategy's pre-launch check, repeated in every
rank): what needs the Trainer, the run description or the data, beyond the model's configuration."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

from megatron_lite.core.optim.scheduler import schedule_lengths
from megatron_lite.core.parallel.run_spec import RunSpec

if TYPE_CHECKING:
    import lightning.pytorch as pl


def check_module_run(module: Any, run: RunSpec, trainer: "pl.Trainer", datamodule: Optional[Any]) -> None:
    """Refuse, naming the fix, what ``module`` (a GPTModule) cannot run under ``trainer`` as ``run`` describes: an LR
    schedule that does not fit, ramp-up with an iteration-based schedule, Lightning's gradient accumulation or
    clipping (the module does both itself), a ``loss_fn`` override under pipeline or context parallelism, overlapped
    reduction with tied embeddings across stages, data with a larger vocabulary than the model."""
    if trainer.state.fn == "fit":
        schedule_lengths(module.optimizer_config, trainer.max_steps)  # every schedule check, in its unit
        cfg = module.optimizer_config
        if (
            run.data is not None
            and run.data.rampup_batch_size
            and not cfg.sample_based
            and (cfg.lr_decay_style != "constant" or cfg.lr_warmup_iters > 0)
        ):
            # Megatron refuses iteration-based schedules with ramp-up: steps of different sizes.
            raise ValueError(
                "rampup_batch_size with an iteration-based LR schedule: steps consume different numbers of "
                "samples during the ramp, so set the schedule in samples (lr_warmup_samples, lr_decay_samples, "
                "lr_wsd_decay_samples) or use lr_decay_style='constant' without warmup."
            )
        if trainer.accumulate_grad_batches != 1:
            raise ValueError(
                f"accumulate_grad_batches={trainer.accumulate_grad_batches}: GPTModule accumulates gradients "
                f"over microbatches itself; raise the datamodule's global_batch_size instead (it is split into "
                f"global_batch_size / (micro_batch_size x dp) microbatches per step)."
            )
        _check_pipeline(module, run)
        if trainer.gradient_clip_val:
            raise ValueError(
                f"Trainer(gradient_clip_val={trainer.gradient_clip_val}): GPTModule clips the global gradient "
                f"norm across every parallel rank itself; set OptimizerConfig(clip_grad=...) instead."
            )
    if trainer.state.fn != "predict" and run.parallel.context_parallel_size > 1 and module._overrides_loss_fn():
        # predict runs whole sequences on every CP rank
        raise ValueError(
            f"{type(module).__name__} overrides loss_fn, which is given whole {{'tokens': [b, s+1]}} microbatches; "
            f"under context parallelism each rank holds a share of every sequence ('tokens' and 'labels' "
            f"[b, s/C]): override forward_step(part, microbatch, input_tensor) and loss(output, microbatch) "
            f"instead, or set context_parallel_size=1."
        )
    module._check_vocab(datamodule)


def _check_pipeline(module: Any, run: RunSpec) -> None:
    if run.parallel.pipeline_model_parallel_size == 1:
        return
    if module._overrides_loss_fn():
        raise ValueError(
            f"{type(module).__name__} overrides loss_fn, which runs the whole model in one call; under pipeline "
            f"parallelism each stage runs only its layers: override forward_step(part, microbatch, input_tensor) "
            f"and loss(output, microbatch) instead, or set pipeline_model_parallel_size=1."
        )
    if module.config.share_embeddings_and_output_weights and run.overlap_grad_reduce:
        raise ValueError(
            "overlap_grad_reduce=True with tied embeddings under pipeline parallelism: the embedding's gradient "
            "must be summed over the first and last stage before its bucket is reduced; set "
            "share_embeddings_and_output_weights=False or overlap_grad_reduce=False."
        )
    if module.config.mtp_num_layers and run.overlap_grad_reduce:
        raise ValueError(
            "overlap_grad_reduce=True with multi-token prediction under pipeline parallelism: the MTP block's copy "
            "of the embedding on the last stage must have its gradient summed with the first stage's before its "
            "bucket is reduced; set overlap_grad_reduce=False or mtp_num_layers=None."
        )

"""The memory estimate of a run as the strategy and ``megatron-lite estimate`` describe it: a
:class:`~megatron_lite.core.parallel.run_spec.RunSpec` (layout, data geometry, precision, FSDP2), the model, the
optimizer settings, what a sample costs the objective and, for a LoRA fine-tune, the adapters it trains
(:func:`trained_lora`)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Optional

from megatron_lite.core.engine.contract import EngineModule
from megatron_lite.core.estimator.memory import EstimateLayout, MemoryEstimate, estimate_memory
from megatron_lite.core.estimator.objective_cost import ObjectiveCost, objective_cost
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.peft.config import LoRAConfig
from megatron_lite.core.peft.lora import lora_recipe

if TYPE_CHECKING:  # run_spec imports the estimator package (its precision names): only the type here
    from megatron_lite.core.parallel.run_spec import RunSpec


def estimate_for_run(
    config: GPTConfig,
    run: "RunSpec",
    optimizer: Any = None,
    *,
    device_type: str = "cuda",
    objective: ObjectiveCost = ObjectiveCost(),
    lora: Optional[LoRAConfig] = None,
) -> MemoryEstimate:
    """Per-rank memory of training ``config`` as ``run`` lays it out (its data's geometry must be declared:
    ``run.data``). ``optimizer``: an ``OptimizerConfig`` (None: Adam without the distributed optimizer). Batch
    sizes count the data's samples; ``objective`` says how many sequences a sample is (a microbatch runs that many
    times its samples as rows) and how many frozen copies of the model the objective holds. ``lora``: the adapters a
    LoRA fine-tune trains on the frozen base (gradients and optimizer state for them only)."""
    if run.data is None:
        raise ValueError(
            "the memory estimate needs the data's batch geometry (micro_batch_size, global_batch_size, "
            "seq_length): give the datamodule a `geometry` (a DataGeometry)"
        )
    run.check_optimizer(optimizer)
    parallel = run.parallel
    layout = EstimateLayout(
        micro_batch_size=run.data.micro_batch_size * objective.sequences_per_sample,
        seq_length=run.data.seq_length,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        data_parallel_size=run.data_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        sequence_parallel=parallel.sequence_parallel,
        virtual_pipeline_model_parallel_size=parallel.virtual_pipeline_model_parallel_size,
        pipeline_schedule=parallel.pipeline_schedule,
        num_layers_in_first_pipeline_stage=parallel.num_layers_in_first_pipeline_stage,
        num_layers_in_last_pipeline_stage=parallel.num_layers_in_last_pipeline_stage,
        pipeline_model_parallel_layout=parallel.pipeline_model_parallel_layout,
        context_parallel_size=parallel.context_parallel_size,
        cp_comm_type=parallel.cp_comm_type,
        cp_fused_blocks=parallel.cp_fused_blocks,
        expert_model_parallel_size=parallel.expert_model_parallel_size,
        expert_tensor_parallel_size=parallel.expert_tensor_parallel_size,
        precision=run.precision,
        use_distributed_optimizer=bool(getattr(optimizer, "use_distributed_optimizer", False)),
        use_torch_fsdp2=run.shards_with_fsdp2,
        optimizer=getattr(optimizer, "optimizer", "adam"),
        sgd_momentum=getattr(optimizer, "sgd_momentum", 0.9),
        num_microbatches=run.data.num_microbatches(run.data_parallel_size),
        device_type=device_type,
        frozen_models=objective.frozen_models,
        lora=lora,
    )
    return estimate_memory(config, layout)


def trained_lora(module: Any, holders: Iterable[Any] = ()) -> Optional[LoRAConfig]:
    """The LoRA configuration a run of ``module`` trains, None if it trains every parameter: the recipe its built
    model carries, else the ``config`` of one of its objective extensions or of ``holders`` (the Trainer's
    callbacks, before their ``setup`` added the extension) that is a :class:`LoRAConfig`."""
    recipe = lora_recipe(getattr(module, "model", None))
    if recipe is not None:
        return recipe[0]
    for holder in (*getattr(module, "objective_extensions", ()), *holders):
        config = getattr(holder, "config", None)
        if isinstance(config, LoRAConfig):
            return config
    return None


def estimate_objective(
    module: Any, run: "RunSpec", datamodule: Any = None, device_type: str = "cuda", holders: Iterable[Any] = ()
) -> Optional[MemoryEstimate]:
    """The estimate of training ``module`` (an :class:`EngineModule`: GPTModule and the objectives built on it) on
    ``datamodule`` as ``run`` describes it, every pipeline stage's in ``.stages``; None when they do not say
    enough (another kind of module or model, data without a declared geometry). A LoRA fine-tune is found by
    :func:`trained_lora` (``holders``: the Trainer's callbacks). An estimate that cannot be made raises
    ValueError/TypeError."""
    if not isinstance(module, EngineModule) or not isinstance(module.config, GPTConfig) or run.data is None:
        return None
    return estimate_for_run(
        module.config,
        run,
        module.optimizer_config,
        device_type=device_type,
        objective=objective_cost(module, datamodule),
        lora=trained_lora(module, holders),
    )

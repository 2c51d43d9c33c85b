"""RunSpec: frozen, derived sizes, and every rule that needs no model checked on construction with the fix named."""

from __future__ import annotations

import dataclasses

import pytest

from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.parallel import ParallelConfig
from megatron_lite.core.parallel.geometry import DataGeometry
from megatron_lite.core.parallel.run_spec import RunSpec


def test_derived_sizes_and_equality():
    run = RunSpec(
        ParallelConfig(tensor_model_parallel_size=2),
        world_size=8,
        data=DataGeometry(2, 32, 16),
        precision="bf16",
        use_torch_fsdp2=True,
    )
    assert run.data_parallel_size == 4 and run.num_microbatches == 4 and run.shards_with_fsdp2
    assert run.precision == "bf16-mixed"  # Lightning's alias, as the strategy's precision plugin names it
    assert run == RunSpec(
        ParallelConfig(tensor_model_parallel_size=2), 8, DataGeometry(2, 32, 16), "bf16-mixed", use_torch_fsdp2=True
    )
    assert not RunSpec(ParallelConfig(tensor_model_parallel_size=2), 2, use_torch_fsdp2=True).shards_with_fsdp2
    assert RunSpec(ParallelConfig(), 1).num_microbatches is None  # data without a declared geometry
    with pytest.raises(dataclasses.FrozenInstanceError):
        run.world_size = 4  # type: ignore[misc]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (
            dict(parallel=ParallelConfig(tensor_model_parallel_size=2), world_size=3),
            r"world size \(3 processes\) must be divisible by the model-parallel size",
        ),
        (
            dict(world_size=2, data=DataGeometry(2, 6, 16)),
            r"global_batch_size \(6\) must be divisible by micro_batch_size \(2\) x data-parallel size \(2\) = 4; "
            r"change "
            r"global_batch_size to a multiple of 4 \(e.g. 4\)",
        ),
        (
            dict(world_size=2, data=DataGeometry(2, 32, 16, rampup_batch_size=[6, 2, 9])),
            r"rampup_batch_size\[0\] .* \(6\) must be a multiple of micro_batch_size \(2\) x data-parallel size \(2\)",
        ),
        (
            dict(
                parallel=ParallelConfig(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
                world_size=2,
                data=DataGeometry(2, 6, 16),
            ),
            r"interleaved pipeline schedule needs the number of microbatches per step to be a multiple of "
            r"pipeline_model_parallel_size \(2\), got 3",
        ),
        (
            dict(world_size=2, precision="bf16-true", use_torch_fsdp2=True),
            r"use_torch_fsdp2=True with precision='bf16-true': FSDP keeps its sharded fp32 parameters",
        ),
        (
            dict(parallel=ParallelConfig(pipeline_model_parallel_size=2), world_size=2, use_torch_fsdp2=True),
            r"use_torch_fsdp2=True with pipeline_model_parallel_size > 1 is not composed yet",
        ),
        (
            dict(parallel=ParallelConfig(context_parallel_size=2), world_size=2, use_torch_fsdp2=True),
            r"use_torch_fsdp2=True with context_parallel_size=2 is not composed yet",
        ),
        (
            dict(parallel=ParallelConfig(expert_model_parallel_size=2), world_size=2, use_torch_fsdp2=True),
            r"use_torch_fsdp2=True with expert_model_parallel_size=2 and expert_tensor_parallel_size=1 .* not composed "
            r"yet .*use_distributed_optimizer=True",
        ),
        (
            dict(
                parallel=ParallelConfig(tensor_model_parallel_size=2, expert_tensor_parallel_size=1),
                world_size=2,
                use_torch_fsdp2=True,
            ),
            r"expert_tensor_parallel_size=1 \(tensor_model_parallel_size=2\) is not composed yet",
        ),
        (dict(world_size=1, ddp_bucket_size=0), r"ddp_bucket_size must be a positive number of elements, got 0"),
        (dict(world_size=1, precision="fp8"), r"unknown precision 'fp8'"),
    ],
)
def test_bad_runs_are_refused_on_construction_naming_the_fix(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RunSpec(**{"parallel": ParallelConfig(), **kwargs})


def test_the_distributed_optimizer_beside_fsdp2_is_refused():
    zero1 = OptimizerConfig(use_distributed_optimizer=True)
    RunSpec(ParallelConfig(), 2).check_optimizer(zero1)  # without FSDP2: fine
    with pytest.raises(ValueError, match=r"use_torch_fsdp2=True already shards optimizer state"):
        RunSpec(ParallelConfig(), 2, use_torch_fsdp2=True).check_optimizer(zero1)

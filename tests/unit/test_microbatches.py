"""Batch-size ramp-up: the calculators follow Megatron's formula, bad sizes are refused with the fix named, and
the samplers/datamodules hand every step a global batch of the ramped size, in order, resumable at any step."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.microbatches import (
    ConstantNumMicroBatchesCalculator,
    RampupBatchsizeNumMicroBatchesCalculator,
    build_num_microbatches_calculator,
    consumed_samples_after,
)
from megatron_lite.core.parallel.run_spec import RunSpec
from megatron_lite.data.datamodule import RampupDataLoader
from megatron_lite.data.geometry import DataGeometry
from megatron_lite.data.indexed_dataset import write_dataset
from megatron_lite.data.mock import MockGPTDataModule
from megatron_lite.data.pretrain import PretrainDataModule
from megatron_lite.data.random_sampler import MegatronPretrainingRandomSampler
from megatron_lite.data.samplers import MegatronPretrainingSampler, RankBatchSampler


def megatron_batch_size(consumed: int, gbs: int, ramp: list[int]) -> int:
    """Megatron-LM's RampupBatchsizeNumMicroBatchesCalculator.update, written out."""
    start, increment, ramp_samples = ramp
    if consumed > ramp_samples:
        return gbs
    samples_per_increment = ramp_samples / ((gbs - start) // increment)
    return start + int(consumed / samples_per_increment) * increment


# (gbs, mbs, dp, [start, increment, rampup samples]); the last ones have a non-integer samples-per-increment, and
# in (32, 2, 2, [4, 4, 58]) float rounding makes Megatron give 28, not 32, at exactly 58 consumed samples
CONFIGS = [
    (32, 2, 1, [4, 4, 100]),
    (32, 2, 2, [8, 8, 96]),
    (48, 1, 4, [8, 4, 1000]),
    (64, 2, 4, [16, 8, 77]),
    (1024, 4, 8, [32, 32, 30000]),
    (32, 2, 2, [4, 4, 58]),
]


@pytest.mark.parametrize(("gbs", "mbs", "dp", "ramp"), CONFIGS)
def test_rampup_calculator_follows_megatrons_formula(gbs: int, mbs: int, dp: int, ramp: list[int]) -> None:
    calculator = build_num_microbatches_calculator(gbs, mbs, dp, ramp)
    assert isinstance(calculator, RampupBatchsizeNumMicroBatchesCalculator)
    assert calculator.get() == ramp[0] // (mbs * dp) and calculator.get_current_global_batch_size() == ramp[0]
    seen = set()
    for consumed in [*range(0, ramp[2] + 3 * gbs), 10 * ramp[2], 10**9]:
        expected = megatron_batch_size(consumed, gbs, ramp)
        calculator.update(consumed, consistency_check=True)
        assert calculator.get_current_global_batch_size() == expected == calculator.global_batch_size_at(consumed)
        assert calculator.get() * mbs * dp == expected and calculator.get_micro_batch_size() == mbs
        seen.add(expected)
    assert seen == set(range(ramp[0], gbs + 1, ramp[1]))  # every stage of the ramp is reached
    # the samples consumed by the first n steps, each step taking the batch size of its start
    consumed, after = 0, [0]
    for _ in range(400):
        consumed += megatron_batch_size(consumed, gbs, ramp)
        after.append(consumed)
    assert [consumed_samples_after(calculator, n) for n in range(401)] == after


def test_a_ramp_by_hand_and_the_constant_calculator() -> None:
    ramp = build_num_microbatches_calculator(32, 2, 2, [8, 8, 96])  # 32 samples per stage: 8, 16, 24, then 32
    sizes = [consumed_samples_after(ramp, n + 1) - consumed_samples_after(ramp, n) for n in range(11)]
    assert sizes == [8, 8, 8, 8, 16, 16, 24, 24, 32, 32, 32]
    assert [ramp.global_batch_size_at(c) for c in (31, 32, 63, 64, 95, 96, 97)] == [8, 16, 16, 24, 24, 32, 32]
    constant = build_num_microbatches_calculator(32, 2, 2)
    assert isinstance(constant, ConstantNumMicroBatchesCalculator) and constant.get() == 8
    constant.update(12345, consistency_check=True)
    assert constant.get_current_global_batch_size() == 32 and consumed_samples_after(constant, 7) == 7 * 32
    rounded = build_num_microbatches_calculator(32, 2, 2, [4, 4, 58])
    assert [rounded.global_batch_size_at(c) for c in (57, 58, 59)] == [28, 28, 32]  # Megatron's float rule
    flat = build_num_microbatches_calculator(32, 2, 2, [32, 8, 96])  # start == global batch: nothing to ramp
    assert {flat.global_batch_size_at(c) for c in range(200)} == {32}


@pytest.mark.parametrize(
    ("args", "message"),
    [
        ((32, 2, 1, [4, 6, 100]), r"32 - 4 = 28\) must be divisible by the increment \(6\)"),
        ((32, 2, 2, [6, 2, 100]), r"rampup_batch_size\[0\] .* \(6\) must be a multiple of .* = 4"),
        ((32, 2, 2, [8, 2, 100]), r"rampup_batch_size\[1\] .* \(2\) must be a multiple of .* = 4"),
        ((32, 2, 1, [64, 8, 100]), r"start batch rampup_batch_size\[0\] \(64\) exceeds global_batch_size \(32\)"),
        ((32, 2, 1, [0, 4, 100]), r"rampup_batch_size\[0\] .*positive integer, got 0"),
        ((32, 2, 1, [4, -4, 100]), r"rampup_batch_size\[1\] .*positive integer, got -4"),
        ((32, 2, 1, [4, 4, 0]), r"rampup_batch_size\[2\] \(rampup_samples\) must be a positive integer, got 0"),
        ((32, 2, 1, [4, 4, 10.5]), r"rampup_batch_size\[2\] .*got 10.5"),
        ((32, 2, 1, [True, 4, 10]), r"rampup_batch_size\[0\] .*got True"),
        ((32, 2, 1, [4, 4]), r"must be \[start_global_batch_size, batch_size_increment, rampup_samples\]"),
        ((32, 2, 1, "4 4 100"), r"must be \[start_global_batch_size"),
        ((0, 2, 1, [4, 4, 100]), r"global_batch_size must be a positive integer"),
        ((32, 0, 1, None), r"micro_batch_size must be a positive integer"),
        ((32, 2, -1, [4, 4, 100]), r"data_parallel_size must be a positive integer"),
        ((30, 2, 2, None), r"global_batch_size \(30\) must be a multiple of .* = 4"),
    ],
)
def test_bad_sizes_are_refused_naming_the_fix(args: tuple, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        build_num_microbatches_calculator(*args)


def test_bad_positions_and_ramp_checks_in_geometry_and_the_run_spec() -> None:
    calculator = build_num_microbatches_calculator(32, 2, 1, [4, 4, 100])
    with pytest.raises(ValueError, match="consumed_samples must be an integer >= 0"):
        calculator.update(-1, consistency_check=True)
    with pytest.raises(ValueError, match="steps must be an integer >= 0"):
        consumed_samples_after(calculator, -2)
    geometry = DataGeometry(micro_batch_size=2, global_batch_size=32, seq_length=8, rampup_batch_size=[4, 4, 100])
    assert geometry.rampup_batch_size == (4, 4, 100) and geometry.num_microbatches_calculator(1) == calculator
    with pytest.raises(ValueError, match=r"rampup_batch_size\[0\] .* \(4\) must be a multiple of .* = 8"):
        geometry.num_microbatches_calculator(4)  # what DP 4 adds: 4 samples cannot split into 4 x 2
    with pytest.raises(ValueError, match=r"rampup_batch_size\[1\] .* \(3\) must be a multiple of"):
        DataGeometry(micro_batch_size=2, global_batch_size=30, seq_length=8, rampup_batch_size=[6, 3, 100])

    def ramp(world_size: int, rampup_batch_size: list) -> RunSpec:
        return RunSpec(ParallelConfig(), world_size, DataGeometry(2, 32, 8, rampup_batch_size=rampup_batch_size))

    assert ramp(2, [8, 8, 9]).data_parallel_size == 2
    with pytest.raises(
        ValueError,
        match=r"rampup_batch_size\[0\] .* \(6\) must be a multiple of micro_batch_size "
        r"\(2\) x data-parallel size \(2\) = 4",
    ):
        ramp(2, [6, 2, 9])
    with pytest.raises(ValueError, match=r"data-parallel size \(4\) = 8.*device count"):
        ramp(4, [8, 4, 9])


# ---------------------------------------------------------------- samplers under a ramp-up

TOTAL, GBS, MBS, RAMP = 100, 16, 1, [4, 4, 150]  # passes of 96 samples; a batch grows by 4 every 50 samples
STEPS = 32  # spans 4 passes; the first two end on a batch that no longer fits, the ramp crosses the first end


def expected_sequential(steps: int, total: int = TOTAL) -> list[list[int]]:
    """The order by definition: consecutive batches of the ramped size; one that does not fit in the rest of a
    pass (96 samples of 100) starts the next pass at 0."""
    usable, consumed, offset, batches = total - total % GBS, 0, 0, []
    for _ in range(steps):
        size = megatron_batch_size(consumed, GBS, RAMP)
        if offset + size > usable:
            offset = 0
        batches.append(list(range(offset, offset + size)))
        offset += size
        consumed += size
    return batches


def ramp_steps(make, dp: int, steps: int, consumed: int = 0) -> list[list[int]]:
    """Global batches (rank batches concatenated in rank order) of ``steps`` steps from ``iter_batches``,
    re-iterating when a pass ends as Lightning does per epoch."""
    calculator = build_num_microbatches_calculator(GBS, MBS, dp, RAMP)
    samplers = [make(consumed, dp, rank, calculator) for rank in range(dp)]
    iterators = [s.iter_batches() for s in samplers]
    batches = []
    for _ in range(steps):
        batch: list[int] = []
        for rank, sampler in enumerate(samplers):
            try:
                local = next(iterators[rank])
            except StopIteration:
                iterators[rank] = sampler.iter_batches()
                local = next(iterators[rank])
            assert len(local) * dp == megatron_batch_size(sampler.consumed_samples - len(local) * dp, GBS, RAMP)
            batch += local
        batches.append(batch)
    assert len({s.consumed_samples for s in samplers}) == 1
    return batches


def sequential(consumed: int, dp: int, rank: int, calculator) -> MegatronPretrainingSampler:
    return MegatronPretrainingSampler(TOTAL, consumed, GBS, dp, rank, calculator=calculator)


def cyclic(sharding: bool):
    return lambda consumed, dp, rank, calculator: MegatronPretrainingRandomSampler(
        TOTAL, consumed, GBS, dp, rank, seed=3, data_sharding=sharding, calculator=calculator
    )


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sequential_ramp_is_the_sequential_order_and_resumes_at_every_step(dp: int) -> None:
    full = ramp_steps(sequential, dp, STEPS)
    assert full == expected_sequential(STEPS)  # every rank slice in place: no duplicate, no gap, at any DP
    assert [len(b) for b in full[:26]] == [4] * 13 + [8] * 6 + [12] * 5 + [16] * 2
    assert full[18][0] == full[25][0] == 0 and full[17][-1] == 91 and full[24][-1] == 83  # 92 + 8, 84 + 16 > 96
    after = [consumed_samples_after(build_num_microbatches_calculator(GBS, MBS, dp, RAMP), k) for k in range(STEPS)]
    for k in range(1, STEPS):  # mid-ramp, at pass ends, after the ramp
        assert ramp_steps(sequential, dp, STEPS - k, consumed=after[k]) == full[k:], k
    # a position off the schedule (saved with other batch sizes) continues at the next step boundary
    assert ramp_steps(sequential, dp, 3, consumed=after[5] - 1) == full[5:8]
    assert ramp_steps(sequential, dp, 3, consumed=after[27] - 5) == full[27:30]  # also after the ramp


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_cyclic_ramp_shuffles_each_pass_without_repeats_and_resumes(dp: int, sharding: bool) -> None:
    make = cyclic(sharding)
    full = ramp_steps(make, dp, STEPS)
    order = expected_sequential(STEPS)
    assert [len(b) for b in full] == [len(b) for b in order]
    starts = [k for k in range(STEPS) if order[k][0] == 0]  # the steps that begin a pass
    for begin, end in zip(starts, starts[1:]):
        seen = sum(full[begin:end], [])
        used = sum(order[begin:end], [])
        assert len(set(seen)) == len(seen) == len(used) and all(0 <= i < 96 for i in seen)  # a pass: no repeats
    assert sum(full[:4], []) != sum(order[:4], [])  # shuffled
    after = [consumed_samples_after(build_num_microbatches_calculator(GBS, MBS, dp, RAMP), k) for k in range(STEPS)]
    for k in (1, 5, 13, 17, 18, 19, 24, 25, 26, 31):
        assert ramp_steps(make, dp, STEPS - k, consumed=after[k]) == full[k:], k
    sampler = make(after[25], dp, 0, build_num_microbatches_calculator(GBS, MBS, dp, RAMP))
    assert sampler.epoch == 2 and starts[2] == 25 and after[25] // 96 == 1  # the epoch comes from the walk


def test_flat_iteration_and_the_batch_sampler() -> None:
    calculator = build_num_microbatches_calculator(GBS, MBS, 2, RAMP)
    flat = list(MegatronPretrainingSampler(TOTAL, 0, GBS, 2, 1, calculator=calculator))
    batched = sum(RankBatchSampler(MegatronPretrainingSampler(TOTAL, 0, GBS, 2, 1, calculator=calculator)), [])
    assert flat == batched == sum((b[len(b) // 2 :] for b in expected_sequential(18)), [])  # the first pass
    with pytest.raises(TypeError):
        len(RankBatchSampler(MegatronPretrainingSampler(TOTAL, 0, GBS, 2, 1, calculator=calculator)))
    with pytest.raises(ValueError, match="build it with the sampler's sizes"):
        MegatronPretrainingSampler(TOTAL, 0, GBS, 4, 1, calculator=calculator)


# ---------------------------------------------------------------- through MockGPTDataModule, no Trainer


def _train_batches(dp: int, global_step: int, steps: int, state: dict | None = None) -> list[torch.Tensor]:
    """Global batches of ``steps`` steps from each rank's train loader (a stand-in trainer gives DP and step)."""
    per_rank = []
    for rank in range(dp):
        dm = MockGPTDataModule(
            seq_length=8,
            micro_batch_size=MBS,
            global_batch_size=GBS,
            vocab_size=50,
            num_train_samples=TOTAL,
            rampup_batch_size=RAMP,
        )
        dm.trainer = SimpleNamespace(  # type: ignore[assignment]
            strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank}),
            global_step=global_step,
        )
        if state is not None:
            dm.load_state_dict(state)
        loader = dm.train_dataloader()
        assert isinstance(loader, RampupDataLoader) and isinstance(loader.sampler, DistributedSampler)
        batches, iterator = [], iter(loader)
        for _ in range(steps):
            try:
                batches.append(next(iterator)["tokens"])
            except StopIteration:  # the pass ended: Lightning starts the next epoch with iter()
                iterator = iter(loader)
                batches.append(next(iterator)["tokens"])
        per_rank.append(batches)
        val = next(iter(dm.val_dataloader()))["tokens"]
        assert val.shape == (GBS // dp, 9)  # evaluation keeps the full global batch
    return [torch.cat([r[k] for r in per_rank]) for k in range(steps)]


def test_datamodule_batches_follow_the_ramp_and_resume_from_step_or_state() -> None:
    dataset = MockGPTDataModule(
        seq_length=8, micro_batch_size=MBS, global_batch_size=GBS, vocab_size=50, num_train_samples=TOTAL
    ).train_dataset
    full = _train_batches(2, 0, 14)
    expected = [torch.stack([dataset[i]["tokens"] for i in batch]) for batch in expected_sequential(14)]
    assert all(torch.equal(a, b) for a, b in zip(full, expected))
    resumed = _train_batches(4, 7, 7)  # from trainer.global_step
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[7:]))
    dm = MockGPTDataModule(seq_length=8, micro_batch_size=MBS, global_batch_size=GBS, rampup_batch_size=RAMP)
    dm.trainer = SimpleNamespace(strategy=None, global_step=5)  # type: ignore[assignment]
    state = dm.state_dict()
    assert state == {"consumed_samples": 5 * 4}  # the samples of 5 ramped steps, not 5 x 16
    resumed = _train_batches(1, 0, 9, state=state)
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[5:]))
    with pytest.raises(ValueError, match=r"rampup_batch_size\[0\] .* \(4\) must be a multiple of .* = 8"):
        _train_batches(8, 0, 1)  # DP 8 cannot split the first batches of 4


def test_pretrain_layout_change_warning_follows_the_ramped_passes(tmp_path) -> None:
    """The cyclic sampler's 'DP size changed mid-epoch' warning knows where ramped passes end."""
    prefix = str(tmp_path / "corpus")
    rng = np.random.default_rng(0)
    write_dataset(prefix, [[rng.integers(1, 500, size=int(rng.integers(5, 60)))] for _ in range(60)], dtype=np.uint16)

    def resumed(consumed: int) -> PretrainDataModule:
        dm = PretrainDataModule(
            [prefix],
            seq_length=16,
            micro_batch_size=1,
            global_batch_size=GBS,
            split="90,10",
            sampler="cyclic",
            vocab_size=500,
            train_samples=TOTAL,
            rampup_batch_size=RAMP,
            cache_dir=str(tmp_path / "cache"),
        )
        dm.trainer = SimpleNamespace(  # type: ignore[assignment]
            strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": 4, "rank": 0}), global_step=0
        )
        dm.load_state_dict(
            {"consumed_samples": consumed, "sampler": "cyclic", "data_sharding": True, "data_parallel_size": 2}
        )
        return dm

    probe = resumed(0)
    probe.setup("fit")
    total = len(probe.train_dataset)  # type: ignore[arg-type]
    order = expected_sequential(40, total)
    second_pass = sum(len(batch) for batch in order[: next(k for k in range(1, 40) if order[k][0] == 0)])
    assert second_pass % (total - total % GBS) != 0  # where an unramped run would be mid-epoch
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        resumed(second_pass).train_dataloader()
    with pytest.warns(UserWarning, match="data-parallel size 4 after 2, mid-epoch"):
        resumed(second_pass + 16).train_dataloader()

"""Samplers: a resumed run sees exactly the uninterrupted run's samples, at DP 1/2/4 and across DP changes."""

from __future__ import annotations

import warnings
from collections.abc import Callable
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from torch.utils.data.distributed import DistributedSampler

from megatron_lite.core.parallel.microbatches import build_num_microbatches_calculator
from megatron_lite.data.indexed_dataset import write_dataset
from megatron_lite.data.pretrain import PretrainDataModule
from megatron_lite.data.random_sampler import MegatronPretrainingRandomSampler
from megatron_lite.data.samplers import MegatronPretrainingSampler

TOTAL, GBS, STEPS = 53, 8, 20  # 6 global batches per epoch (5 samples dropped): 20 steps span 4 epochs

MakeSampler = Callable[[int, int, int], DistributedSampler]  # (consumed, dp, rank) -> sampler


def sequential(consumed: int, dp: int, rank: int) -> DistributedSampler:
    return MegatronPretrainingSampler(TOTAL, consumed, GBS, dp, rank)


def cyclic(sharding: bool, seed: int = 3) -> MakeSampler:
    return lambda consumed, dp, rank: MegatronPretrainingRandomSampler(
        TOTAL, consumed, GBS, dp, rank, seed=seed, data_sharding=sharding
    )


def run_steps(make: MakeSampler, dp: int, steps: int, consumed: int = 0) -> list[list[int]]:
    """Global batches (rank slices concatenated in rank order) of ``steps`` steps, re-iterating per epoch."""
    samplers = [make(consumed, dp, rank) for rank in range(dp)]
    iterators = [iter(s) for s in samplers]
    batches = []
    for _ in range(steps):
        batch: list[int] = []
        for rank, sampler in enumerate(samplers):
            local: list[int] = []
            while len(local) < GBS // dp:
                try:
                    local.append(next(iterators[rank]))
                except StopIteration:  # the epoch ended: Lightning starts a new one with iter()
                    iterators[rank] = iter(sampler)
            batch += local
        batches.append(batch)
    assert all(s.consumed_samples == consumed + steps * GBS for s in samplers)  # type: ignore[attr-defined]
    return batches


RESUME_POINTS = [1, 4, 6, 7, 13, 19]  # mid-epoch, at epoch ends (6, 12 ...), in later epochs


@pytest.mark.parametrize("dp", [1, 2, 4])
def test_sequential_resume_equals_the_uninterrupted_run(dp: int) -> None:
    full = run_steps(sequential, 1, STEPS)
    assert full[:6] == [list(range(k * GBS, (k + 1) * GBS)) for k in range(6)] and full[6] == full[0]
    assert run_steps(sequential, dp, STEPS) == full
    for k in RESUME_POINTS:
        assert run_steps(sequential, dp, k) + run_steps(sequential, dp, STEPS - k, consumed=k * GBS) == full


@pytest.mark.parametrize(("before", "after"), [(2, 4), (4, 2), (2, 1), (1, 4)])
def test_sequential_resume_after_a_dp_change_is_exact(before: int, after: int) -> None:
    full = run_steps(sequential, 1, STEPS)
    for k in RESUME_POINTS:
        assert run_steps(sequential, before, k) + run_steps(sequential, after, STEPS - k, consumed=k * GBS) == full


@pytest.mark.parametrize("sharding", [True, False])
@pytest.mark.parametrize("dp", [1, 2, 4])
def test_cyclic_sampler_epochs_and_resume(dp: int, sharding: bool) -> None:
    make = cyclic(sharding)
    full = run_steps(make, dp, STEPS)
    usable = TOTAL - TOTAL % GBS
    epochs = [sum(full[e * 6 : (e + 1) * 6], []) for e in range(3)]
    assert all(sorted(e) == list(range(usable)) for e in epochs)  # every epoch: each usable sample once
    assert epochs[0] != epochs[1] != epochs[2]  # a new permutation per epoch
    for k in RESUME_POINTS:
        assert run_steps(make, dp, k) + run_steps(make, dp, STEPS - k, consumed=k * GBS) == full
    assert run_steps(cyclic(sharding, seed=4), dp, 6) != full[:6]


def test_cyclic_without_sharding_is_independent_of_dp_and_sharding_is_not() -> None:
    unsharded = cyclic(False)
    full = run_steps(unsharded, 1, STEPS)
    assert run_steps(unsharded, 2, STEPS) == run_steps(unsharded, 4, STEPS) == full
    for k in RESUME_POINTS:
        assert run_steps(unsharded, 2, k) + run_steps(unsharded, 4, STEPS - k, consumed=k * GBS) == full
    # with sharding each rank owns a bucket of indices that depends on the DP size
    sharded = cyclic(True)
    assert run_steps(sharded, 2, 6) != run_steps(sharded, 4, 6)
    first_batch = run_steps(sharded, 2, 1)[0]
    assert all(i < 24 for i in first_batch[:4]) and all(i >= 24 for i in first_batch[4:])


def test_sharded_cyclic_with_seed_0_is_megatrons_order() -> None:
    """Megatron's sharded random sampler (seeded by the epoch alone) per rank, for a total of whole batches."""
    total, gbs, dp, mbs = 48, 8, 2, 2
    for rank in range(dp):
        bucket = (total // (mbs * dp)) * mbs
        megatron: list[int] = []
        for epoch in range(2):
            g = torch.Generator()
            g.manual_seed(epoch)
            megatron += [rank * bucket + x for x in torch.randperm(bucket, generator=g).tolist()]
        ours = MegatronPretrainingRandomSampler(total, 0, gbs, dp, rank, seed=0)
        assert list(ours) + list(ours) == megatron


def test_random_sampler_checks_and_state() -> None:
    s = MegatronPretrainingRandomSampler(TOTAL, 0, GBS, 2, 1, seed=1)
    assert isinstance(s, DistributedSampler) and len(s) == 24 and s.epoch == 0
    it = iter(s)
    [next(it) for _ in range(4)]
    assert s.state_dict() == {"consumed_samples": 8, "num_replicas": 2, "data_sharding": True, "seed": 1}
    s.load_state_dict({"consumed_samples": 48})
    assert s.epoch == 1
    for kwargs, message in (
        ({"num_replicas": 3}, "multiple of 3"),
        ({"rank": 2}, "rank"),
        ({"total_samples": 7}, "fewer than one global batch"),
        ({"drop_last": False}, "drop_last=True"),
        ({"seed": -1}, "seed"),
    ):
        args = {
            "total_samples": TOTAL,
            "consumed_samples": 0,
            "global_batch_size": GBS,
            "num_replicas": 2,
            "rank": 0,
            **kwargs,
        }
        with pytest.raises(ValueError, match=message):
            MegatronPretrainingRandomSampler(**args)
    # a position off the batch grid (the batch size changed) finishes the epoch and starts the next one
    odd = MegatronPretrainingRandomSampler(TOTAL, 45, GBS, 1, 0, seed=1)
    assert len(list(odd)) == 48 and odd.consumed_samples == 96


def ramped(consumed: int, dp: int, rank: int) -> DistributedSampler:
    calculator = build_num_microbatches_calculator(GBS, 1, dp, [2, 2, 24])
    return MegatronPretrainingSampler(TOTAL, consumed, GBS, dp, rank, calculator=calculator)


@pytest.mark.parametrize("make", [sequential, cyclic(True), ramped], ids=["sequential", "cyclic", "ramp-up"])
def test_read_ahead_is_handed_each_next_batch_of_the_rank_and_changes_neither_order_nor_position(
    make: MakeSampler,
) -> None:
    """The hook the loader sets (the dataset's prefetch_samples) gets this rank's next batch as each batch is taken,
    never past the pass's end; the batches and consumed_samples are those of a sampler without it, also when the
    consumer stops early (a limited epoch) and resumes with the next iteration."""
    plain, hooked = make(3 * GBS, 2, 1), make(3 * GBS, 2, 1)
    announced: list[list[int]] = []
    hooked.read_ahead = announced.append
    for _ in range(2):  # the rest of this pass, then the whole next one
        batches = list(hooked.iter_batches())
        assert batches == list(plain.iter_batches()) and len(batches) > 1
        assert announced == batches[1:] and hooked.consumed_samples == plain.consumed_samples
        announced.clear()
    expected = list(make(hooked.consumed_samples, 2, 1).iter_batches())
    for sampler in (plain, hooked):
        taken = iter(sampler)
        for _ in range(len(expected[0]) + 1):
            next(taken)  # the first batch and the first index of the second, then stop
    assert announced == expected[1:3] and hooked.consumed_samples == plain.consumed_samples
    assert list(hooked) == list(plain)


# ---------------------------------------------------------------- through PretrainDataModule, no Trainer


@pytest.fixture(scope="module")
def corpus(tmp_path_factory: pytest.TempPathFactory) -> str:
    prefix = str(tmp_path_factory.mktemp("data") / "corpus")
    rng = np.random.default_rng(0)
    write_dataset(prefix, [[rng.integers(1, 500, size=int(rng.integers(5, 60)))] for _ in range(120)], dtype=np.uint16)
    return prefix


def _attach(dm: PretrainDataModule, dp: int, rank: int, global_step: int) -> None:
    """A stand-in trainer with what the datamodule reads: strategy sampler kwargs, global_step, max_steps."""
    dm.trainer = SimpleNamespace(  # type: ignore[assignment]
        strategy=SimpleNamespace(distributed_sampler_kwargs={"num_replicas": dp, "rank": rank}),
        global_step=global_step,
        max_steps=12,
    )


def _global_batches(
    corpus: str, dp: int, step: int, steps: int, sampler: str, state: dict | None = None, **kwargs: object
) -> list[torch.Tensor]:
    per_rank = []
    for rank in range(dp):
        dm = PretrainDataModule(
            [corpus],
            seq_length=16,
            micro_batch_size=2,
            global_batch_size=8,
            split="90,10",
            sampler=sampler,
            vocab_size=500,
            **kwargs,
        )  # type: ignore[arg-type]
        _attach(dm, dp, rank, step)
        if state is not None:
            dm.load_state_dict(state)
        dm.setup("fit")
        loader = iter(dm.train_dataloader())
        per_rank.append([next(loader)["tokens"] for _ in range(steps)])
    return [torch.cat([r[k] for r in per_rank]) for k in range(steps)]


@pytest.mark.parametrize("sampler", ["sequential", "cyclic"])
def test_datamodule_resume_across_dp_sizes(corpus: str, sampler: str) -> None:
    sharding = sampler == "sequential"  # the cyclic sampler is DP-independent only without sharding
    full = _global_batches(corpus, 1, 0, 12, sampler, data_sharding=sharding)
    assert all(b.shape == (8, 17) for b in full)
    for dp in (2, 4):
        assert all(
            torch.equal(a, b) for a, b in zip(_global_batches(corpus, dp, 0, 12, sampler, data_sharding=sharding), full)
        )
    state = {"consumed_samples": 5 * 8, "sampler": sampler, "data_sharding": sharding, "data_parallel_size": 2}
    resumed = _global_batches(corpus, 4, 0, 7, sampler, state=state, data_sharding=sharding)
    assert all(torch.equal(a, b) for a, b in zip(resumed, full[5:]))


def test_datamodule_state_and_dp_change_warning(corpus: str) -> None:
    dm = PretrainDataModule(
        [corpus], seq_length=16, micro_batch_size=2, global_batch_size=8, sampler="cyclic", vocab_size=500
    )
    _attach(dm, 2, 0, 3)
    assert dm.state_dict() == {
        "consumed_samples": 24,
        "sampler": "cyclic",
        "data_sharding": True,
        "data_parallel_size": 2,
    }
    resumed = PretrainDataModule(
        [corpus], seq_length=16, micro_batch_size=2, global_batch_size=8, sampler="cyclic", vocab_size=500
    )
    _attach(resumed, 4, 0, 3)
    resumed.load_state_dict(dm.state_dict())
    with pytest.warns(
        UserWarning,
        match="data-parallel size 4 after 2, mid-epoch.*repeat.*sampler='sequential' or data_sharding=False",
    ):
        resumed.train_dataloader()
    # at an epoch boundary a new DP size is harmless: the next epoch is drawn afresh for the new shards
    at_boundary = PretrainDataModule(
        [corpus], seq_length=16, micro_batch_size=2, global_batch_size=8, sampler="cyclic", vocab_size=500
    )
    _attach(at_boundary, 4, 0, 0)
    at_boundary.setup("fit")
    usable = len(at_boundary.train_dataset) // 8 * 8  # type: ignore[arg-type]
    at_boundary.load_state_dict({**dm.state_dict(), "consumed_samples": usable})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        at_boundary.train_dataloader()
    # without a trainer the restored state is handed on as it was loaded
    bare = PretrainDataModule([corpus], seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=500)
    assert bare.state_dict() == {}
    bare.load_state_dict(dm.state_dict())
    assert bare.state_dict() == dm.state_dict()
    other = PretrainDataModule([corpus], seq_length=16, micro_batch_size=2, global_batch_size=8, vocab_size=500)
    _attach(other, 1, 0, 3)
    other.load_state_dict(dm.state_dict())
    with pytest.warns(UserWarning, match="sampler='cyclic', this run uses 'sequential'"):
        other.train_dataloader()

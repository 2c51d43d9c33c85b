"""Shared base for pretraining datamodules: geometry, DP size from the trainer, resumable loaders."""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any, Optional

import lightning.pytorch as pl
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from megatron_lite.core.parallel.microbatches import NumMicroBatchesCalculator, consumed_samples_after
from megatron_lite.data.eval_padding import PaddedEvaluationDataset, masked_padding_sample
from megatron_lite.data.geometry import DataGeometry
from megatron_lite.data.read_ahead import prefetch_samples
from megatron_lite.data.samplers import GlobalBatchSampler, MegatronPretrainingSampler, RankBatchSampler

if TYPE_CHECKING:  # the run description, for the pre-launch check's signature
    from megatron_lite.core.parallel.run_spec import RunSpec


class ResumableDataLoader(DataLoader):
    """A DataLoader that tells Lightning it resumes exactly mid-epoch.

    Its position lives in the sampler's ``consumed_samples``, which the datamodule sets when it builds the
    loader (from the restored state or ``trainer.global_step``), so there is nothing for Lightning to save
    here. Implementing ``state_dict``/``load_state_dict`` only stops Lightning from warning that a mid-epoch
    resume "can cause unreliable results", which is not true of these loaders.
    """

    def __init__(self, dataset: Dataset, *args: Any, **kwargs: Any) -> None:
        """A DataLoader; reading in this process (``num_workers=0``), its sampler hands each next batch to the
        dataset to read ahead (see :mod:`~megatron_lite.data.read_ahead`)."""
        super().__init__(dataset, *args, **kwargs)
        if isinstance(self.sampler, GlobalBatchSampler):
            # with workers the dataset that reads is a copy in another process, out of the sampler's reach
            self.sampler.read_ahead = functools.partial(prefetch_samples, dataset) if self.num_workers == 0 else None

    def state_dict(self) -> dict[str, Any]:
        """Empty: the datamodule's own state holds the resume position."""
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore here (see the class docstring)."""


class RampupDataLoader(ResumableDataLoader):
    """The train loader under a batch-size ramp-up: its ``batch_sampler`` (a :class:`RankBatchSampler`) gives
    each step's batch, whose size changes as the batch ramps up.

    ``sampler`` reports the :class:`GlobalBatchSampler` inside the batch sampler. Lightning looks there to see
    that the data is already split over the data-parallel ranks; finding DataLoader's default sequential
    sampler instead, it would rebuild the loader around a ``DistributedSampler`` of its own.
    """

    @property  # type: ignore[override]
    def sampler(self) -> GlobalBatchSampler:
        """The global-batch sampler that the batch sampler draws from."""
        return self.batch_sampler.sampler  # type: ignore[union-attr]

    @sampler.setter
    def sampler(self, value: Any) -> None:
        """Ignore the default sampler that ``DataLoader.__init__`` stores (it is never used with a batch sampler)."""


class PretrainingDataModule(pl.LightningDataModule):
    """Base class: each train/val batch is ``{"tokens": LongTensor[gbs // dp, seq_length + 1]}``.

    One batch is one optimizer step's worth of samples for this data-parallel rank; the training step
    splits it into microbatches. The train loader starts where the run left off: at the
    ``consumed_samples`` restored from a checkpoint, else at the samples the first ``trainer.global_step``
    steps consumed (Lightning restores ``global_step`` before it builds dataloaders), so a resumed run sees
    exactly the batches an uninterrupted run would.

    Evaluation (validation, test) covers every sample of its split, whatever the batch size: the last global
    batch is filled up with masked-out samples (:meth:`evaluation_padding`), so ``val/loss`` is the mean over
    every loss token of the split. Training passes skip a trailing partial global batch, as Megatron does.

    ``rampup_batch_size = [start, increment, rampup_samples]`` (Megatron's ``--rampup-batch-size``) makes the
    training batches grow from ``start`` to ``global_batch_size`` in steps of ``increment`` over
    ``rampup_samples`` consumed samples: a train batch is then ``gbs(consumed) // dp`` samples. Evaluation
    batches stay at ``global_batch_size``.
    """

    def __init__(
        self,
        seq_length: int,
        micro_batch_size: int,
        global_batch_size: int,
        num_workers: int,
        rampup_batch_size: Optional[list[int]] = None,
    ) -> None:
        """Validate the geometry (and the ramp-up) now, before Lightning spawns any process."""
        super().__init__()
        self._geometry = DataGeometry(
            micro_batch_size=micro_batch_size,
            global_batch_size=global_batch_size,
            seq_length=seq_length,
            rampup_batch_size=rampup_batch_size,
        )
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        self.seq_length = seq_length
        self.micro_batch_size = micro_batch_size
        self.global_batch_size = global_batch_size
        self.rampup_batch_size = None if rampup_batch_size is None else list(rampup_batch_size)
        self.num_workers = num_workers
        # consumed_samples loaded from a checkpoint; used once, by the next train_dataloader()
        self._restored_consumed_samples: int | None = None
        # (consumed samples, global step) where this run resumed: later steps count from there with this run's
        # batch sizes, so a run resumed with another global_batch_size keeps an exact count
        self._resumed_from: tuple[int, int] | None = None

    @property
    def geometry(self) -> DataGeometry:
        """Micro/global batch size and sequence length of this datamodule."""
        return self._geometry

    def check_before_launch(
        self, run: RunSpec, trainer: Optional[pl.Trainer] = None, module: Any = None, datamodule: Any = None
    ) -> None:
        """Check the input files (MegatronStrategy's pre-launch check): in the launching process before any rank
        starts, so a bad file fails once, with one message, instead of in every rank after launch.
        Subclasses that read files override it (nothing to check here)."""

    def _dp_size_and_rank(self) -> tuple[int, int]:
        """Data-parallel size and rank from the attached trainer's strategy; (1, 0) without one."""
        trainer = self.trainer
        # SingleDeviceStrategy has no distributed_sampler_kwargs at all, hence getattr
        kw = getattr(trainer.strategy, "distributed_sampler_kwargs", None) if trainer is not None else None
        if not kw:
            return 1, 0
        num_replicas = kw.get("num_replicas")
        rank = kw.get("rank")
        return (1 if num_replicas is None else int(num_replicas)), (0 if rank is None else int(rank))

    def consumed_samples_after(self, steps: int) -> int:
        """Samples the first ``steps`` optimizer steps consume: ``steps * global_batch_size`` without ramp-up."""
        # batch sizes do not depend on the DP size (only whether they divide by it), so DP 1 serves every layout
        return consumed_samples_after(self._geometry.num_microbatches_calculator(1), steps)

    def _consumed_at_start(self) -> int:
        """Samples already consumed when training (re)starts: restored state, else those of global_step steps."""
        if self._restored_consumed_samples is not None:
            consumed, self._restored_consumed_samples = self._restored_consumed_samples, None
            # Lightning restored global_step before it asked for the loader: the step these samples were reached at
            self._resumed_from = (consumed, int(self.trainer.global_step) if self.trainer is not None else 0)
            return consumed
        return self._consumed_now()

    def _consumed_now(self) -> int:
        """Samples consumed by the optimizer steps taken so far (``trainer.global_step`` of them)."""
        step = int(self.trainer.global_step) if self.trainer is not None else 0
        if self._resumed_from is None or step < self._resumed_from[1]:  # not resumed, or a new run from scratch
            return self.consumed_samples_after(step)
        consumed, resumed_at = self._resumed_from
        calculator = self._geometry.num_microbatches_calculator(1)
        for taken in range(max(0, step - resumed_at)):
            size = calculator.global_batch_size_at(consumed)
            if size == calculator.global_batch_size:  # past any ramp-up: every remaining step is a full one
                return consumed + (step - resumed_at - taken) * size
            consumed += size
        return consumed

    def _loader(self, dataset: Dataset, split: str, consumed_samples: int = 0) -> ResumableDataLoader:
        """A DataLoader whose batches are this rank's slice of one global batch of ``split``.

        The order comes from ``_make_sampler``, which subclasses override to use another sampler. Under a
        ramp-up the train loader is a :class:`RampupDataLoader` whose batch sizes follow the ramp.
        """
        if split != "train":
            dataset = self._padded_for_evaluation(dataset, split)
        total_samples = len(dataset)  # type: ignore[arg-type]
        dp_size, rank = self._dp_size_and_rank()
        local_batch = self._geometry.local_batch_size(dp_size)
        if total_samples < self.global_batch_size:
            raise ValueError(
                f"the {split} split has {total_samples} samples of {self.seq_length + 1} tokens, fewer than one "
                f"global batch ({self.global_batch_size}); {self._too_small_hint(split)}{eval_skip_hint(split)}"
            )
        calculator = None
        if split == "train" and self.rampup_batch_size is not None:
            calculator = self._geometry.num_microbatches_calculator(dp_size)
        sampler = self._make_sampler(total_samples, consumed_samples, dp_size, rank, split, calculator)
        workers = dict(num_workers=self.num_workers, persistent_workers=self.num_workers > 0)
        if calculator is not None:
            return RampupDataLoader(dataset, batch_sampler=RankBatchSampler(sampler), **workers)
        return ResumableDataLoader(dataset, batch_size=local_batch, sampler=sampler, drop_last=True, **workers)

    def evaluation_padding(self, sample: Any) -> Optional[dict[str, Any]]:
        """A sample that counts for nothing in an evaluation metric, shaped like ``sample`` (the split's first),
        to fill up the split's last global batch; None when this data's samples cannot be masked out.

        Here: a GPT token sample with ``loss_mask`` all 0 (see :mod:`megatron_lite.data.eval_padding`); samples
        holding anything else (preference pairs, prompts) get None. Override it for samples of your own.
        """
        return masked_padding_sample(sample)

    def _padded_for_evaluation(self, dataset: Dataset, split: str) -> Dataset:
        """``dataset`` padded to whole global batches with :meth:`evaluation_padding`, so that every sample is
        evaluated whatever the batch size; unchanged (with a warning that says what is left out) if it cannot be."""
        total = len(dataset)  # type: ignore[arg-type]
        rest = total % self.global_batch_size
        if total == 0 or rest == 0:
            return dataset
        padding = self.evaluation_padding(dataset[0])
        if padding is not None:
            return PaddedEvaluationDataset(dataset, total - rest + self.global_batch_size, padding)
        if total > self.global_batch_size:  # fewer than one batch: _loader refuses the split
            rank_zero_warn(
                f"the last {rest} of the {total} samples of the {split} split are not evaluated ({type(self).__name__}"
                f"'s samples cannot be padded with masked-out ones), so the {split} metrics depend on "
                f"global_batch_size; make the split a multiple of global_batch_size ({self.global_batch_size}) "
                f"to evaluate every sample"
            )
        return dataset

    def _make_sampler(
        self,
        total_samples: int,
        consumed_samples: int,
        dp_size: int,
        rank: int,
        split: str,
        calculator: Optional[NumMicroBatchesCalculator] = None,
    ) -> GlobalBatchSampler:
        """The sampler of ``_loader``: Megatron's sequential one, for every split; ``calculator`` (train under a
        ramp-up) gives each step's global batch size.

        Evaluation splits rewind to their start on every run so val/loss stays comparable across runs.
        """
        return MegatronPretrainingSampler(
            total_samples=total_samples,
            consumed_samples=consumed_samples,
            global_batch_size=self.global_batch_size,
            num_replicas=dp_size,
            rank=rank,
            rewind=split != "train",
            calculator=calculator,
        )

    def _too_small_hint(self, split: str) -> str:
        """How to fix a split that holds less than one global batch (subclasses name their knobs)."""
        return "lower global_batch_size or seq_length"

    def state_dict(self) -> dict[str, Any]:
        """Saved in Lightning checkpoints: samples consumed by the optimizer steps taken so far."""
        if self.trainer is not None:
            return {"consumed_samples": self._consumed_now()}
        if self._restored_consumed_samples is not None:
            return {"consumed_samples": self._restored_consumed_samples}
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore ``consumed_samples``; the next train_dataloader() starts there."""
        if "consumed_samples" in state_dict:
            self._restored_consumed_samples = int(state_dict["consumed_samples"])


def eval_skip_hint(split: str) -> str:
    """An evaluation split can also just be skipped."""
    if split == "train":
        return ""
    return f"; or skip it with Trainer(limit_{'val' if split == 'validation' else 'test'}_batches=0)"

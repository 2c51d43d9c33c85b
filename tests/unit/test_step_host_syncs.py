"""Host syncs in one training step, counted on CPU (tests/gpu/test_host_syncs_cuda.py checks the same on a GPU
under torch.cuda.set_sync_debug_mode("error")).

Every read of a device value into Python (``.item()``, ``float(t)``, ``bool(t)``, ``if t:``) dispatches
``aten._local_scalar_dense``; ``nonzero`` and friends size their output from the data. A dispatch mode sees each
call on CPU too, so the count of such calls inside ``TrainingEngine.train_step`` is the number of times a GPU step
would stall the host. The torch optimizer's own step runs uncounted: with ``capturable=False`` (our AdamW/SGD)
its step counters are host tensors even on a GPU, so its ``.item()`` calls read no device memory.
"""

import traceback
from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import megatron_lite as ml
from megatron_lite.core.engine import TrainingEngine, report_entry
from megatron_lite.core.optim.distributed import DistributedOptimizer
from megatron_lite.core.optim.optimizer import MegatronOptimizer
from megatron_lite.core.parallel.layout import ParallelLayout
from megatron_lite.core.parallel.schedules import gpt_forward_step, masked_token_loss

LAYOUT = ParallelLayout.single()
READS_DEVICE = {"_local_scalar_dense", "is_nonzero", "equal", "nonzero", "masked_select", "unique", "_unique2"}
"""Ops that read a tensor's data into the host (a device sync on a GPU)."""


class HostSyncs(TorchDispatchMode):
    """Counts the ops of :data:`READS_DEVICE` dispatched while active, by op and megatron_lite source line."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: Counter = Counter()
        self.paused = False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func._schema.name.split("::")[-1]
        if name in READS_DEVICE and not self.paused:
            ours = [f for f in traceback.extract_stack() if "megatron_lite" in f.filename]
            where = f"{ours[-1].filename.rsplit('megatron_lite/', 1)[-1]}:{ours[-1].lineno}" if ours else "torch"
            self.seen[f"{name} at {where}"] += 1
        return func(*args, **(kwargs or {}))

    def uncounted(self, step):
        self.paused = True
        try:
            return step()
        finally:
            self.paused = False


class Objective:
    """GPT's loss, with a reported metric (reduced with the loss: it must not read back either)."""

    def forward_step(self, part, microbatch, input_tensor):
        return gpt_forward_step(part, microbatch, input_tensor)

    def loss(self, output, microbatch):
        total, count = masked_token_loss(output, microbatch)
        return total, count, {"first_token_loss": report_entry(output[:, 0].sum(), output.shape[0])}


def _engine(kind: str, **optimizer) -> TrainingEngine:
    torch.manual_seed(0)
    config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=4, vocab_size=128, seq_length=8)
    model = ml.GPTModel(config, LAYOUT, seed=5)
    cfg = ml.OptimizerConfig(lr=1e-2, clip_grad=0.5, use_distributed_optimizer=kind == "zero1", **optimizer)
    if kind == "fp16":
        opt = MegatronOptimizer(model.to(torch.float16), cfg, LAYOUT, fp16=True)
    elif kind == "zero1":
        opt = DistributedOptimizer(model.to(torch.bfloat16), cfg, LAYOUT)
    else:
        opt = MegatronOptimizer(model, cfg, LAYOUT)
    return TrainingEngine(model, LAYOUT, Objective(), opt)


def _syncs_per_step(engine: TrainingEngine, steps: int = 2) -> Counter:
    g = torch.Generator().manual_seed(1)
    batches = [[{"tokens": torch.randint(0, 128, (2, 9), generator=g)} for _ in range(2)] for _ in range(steps + 1)]
    engine.train_step(batches[0])  # the first step learns the report's names (once per run)
    counter = HostSyncs()
    with counter:
        for microbatches in batches[1:]:
            engine.train_step(microbatches, optimizer_step=lambda: counter.uncounted(engine.optimizer.optimizer.step))
    return Counter({where: n // steps for where, n in counter.seen.items()})


@pytest.mark.parametrize("kind", ["fp32", "zero1"])
def test_a_training_step_without_the_nan_check_reads_nothing_back_from_the_device(kind):
    """Loss normalisation, the report, the global norm and clipping all stay on the device."""
    engine = _engine(kind, check_for_nan_in_grad=False)
    assert _syncs_per_step(engine) == Counter()
    assert engine.optimizer.skipped_steps == 0


@pytest.mark.parametrize("kind", ["fp32", "fp16"])
def test_the_only_sync_of_a_step_is_the_non_finite_check_before_the_update(kind):
    """Raising on NaN gradients (fp32) or skipping an overflowing step (fp16) must be decided before the update:
    one read of one flag per step, in MegatronOptimizer.prepare_step, and nothing else."""
    syncs = _syncs_per_step(_engine(kind))
    assert sum(syncs.values()) == 1, syncs
    (where,) = syncs
    assert where.startswith("_local_scalar_dense at core/optim/optimizer.py:"), syncs

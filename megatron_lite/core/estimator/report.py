"""Human-readable reports of a memory estimate (the ``megatron-lite estimate`` table, the strategy's
start-up log) and the warning when it exceeds the device's memory."""
from __future__ import annotations

from typing import Optional

from megatron_lite.core.estimator.memory import MemoryEstimate

GIB = 1024 ** 3


def format_bytes(n: float) -> str:
    """``1.50 GiB``, ``12.00 MiB``, ``512 B``."""
    for unit, size in (("GiB", GIB), ("MiB", 1024**2), ("KiB", 1024)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def format_table(estimate: MemoryEstimate, flops_per_step: Optional[float] = None) -> str:
    """A human-readable per-rank table of ``estimate`` (and the step's FLOPs when given)."""
    lay, acts = estimate.layout, estimate.activations
    world = lay.tensor_model_parallel_size * lay.pipeline_model_parallel_size * lay.data_parallel_size
    recompute_note = f"recompute: {acts.recompute}"
    copies = f" + {format_bytes(acts.autocast_weight_copies)} autocast weight copies" if acts.autocast_weight_copies \
        else ""
    peak_while = "while the loss is computed" if acts.loss_transient >= acts.recompute_working_set else \
        "while a recomputed chunk is rebuilt"
    sharding = "FSDP2 (weights, grads, optimizer / dp)" if lay.use_torch_fsdp2 else (
        "distributed optimizer" if lay.use_distributed_optimizer else "replicated optimizer")
    rows = [
        f"layout: {world} ranks = tp {lay.tensor_model_parallel_size} x pp {lay.pipeline_model_parallel_size} x dp "
        f"{lay.data_parallel_size}; sequence_parallel={lay.sequence_parallel}, precision={lay.precision}, {sharding}",
        f"micro_batch_size={lay.micro_batch_size}, seq_length={lay.seq_length}, "
        f"microbatches/step={lay.num_microbatches}, kernels of {lay.device_type}",
        f"per rank (pipeline stage {estimate.pipeline_stage}):",
        f"  parameters               {estimate.params:>16,}   (model: {estimate.model_params:,})",
        f"  weights                  {format_bytes(estimate.weights_bytes):>16}",
        f"  gradients                {format_bytes(estimate.grads_bytes):>16}",
        f"  optimizer state          {format_bytes(estimate.optimizer_bytes):>16}   (without distributed optimizer "
        f"{format_bytes(estimate.optimizer_bytes_replicated)}, "
        f"with {format_bytes(estimate.optimizer_bytes_distributed)})",
        f"  activations (peak)       {format_bytes(estimate.activation_bytes):>16}   (held for backward: "
        f"{acts.microbatches_in_flight} microbatch(es) x {format_bytes(acts.embedding + acts.layers + acts.output)}"
        f"{copies}; + {format_bytes(acts.peak - acts.held_after_forward)} {peak_while}; {recompute_note})",
    ]
    if estimate.fsdp_unsharded_bytes:
        rows.append(f"  FSDP2 all-gathered       {format_bytes(estimate.fsdp_unsharded_bytes):>16}")
    rows.append(f"  total                    {format_bytes(estimate.total_bytes):>16}")
    if flops_per_step is not None:
        rows.append(f"FLOPs per step: {flops_per_step:.3e} (model), {flops_per_step / world:.3e} per rank")
    return "\n".join(rows)


def default_device_memory_bytes() -> Optional[int]:
    """Total memory of CUDA device 0 when there is one, else None."""
    import torch

    if not torch.cuda.is_available():
        return None
    return int(torch.cuda.get_device_properties(0).total_memory)


def memory_warning(estimate: MemoryEstimate, device_memory_bytes: Optional[float]) -> Optional[str]:
    """A one-line warning when the per-rank total exceeds the device memory, else None."""
    if device_memory_bytes is None or estimate.total_bytes <= device_memory_bytes:
        return None
    return (f"WARNING: the estimated per-rank total {format_bytes(estimate.total_bytes)} exceeds the device memory "
            f"{format_bytes(device_memory_bytes)}; raise tensor_model_parallel_size, turn on sequence_parallel, the "
            f"distributed optimizer or activation recompute, or lower micro_batch_size")

"""Human-readable reports of a memory estimate (the ``megatron-lite estimate`` table, the strategy's
start-up log) and the warning when it exceeds the device's memory."""

from __future__ import annotations

from typing import Optional

from megatron_lite.core.estimator.memory import MemoryEstimate
from megatron_lite.core.units import GIB, format_bytes  # noqa: F401  (their old place)


def format_table(estimate: MemoryEstimate, flops_per_step: Optional[float] = None) -> str:
    """A human-readable per-rank table of ``estimate`` (and the step's FLOPs when given); under pipeline
    parallelism the details are the most loaded stage's, followed by one line per stage."""
    lay, acts = estimate.layout, estimate.activations
    pp = lay.pipeline_model_parallel_size
    world, cp = lay.world_size, lay.context_parallel_size
    recompute_note = f"recompute: {acts.recompute}"
    copies = (
        f" + {format_bytes(acts.autocast_weight_copies)} autocast weight copies" if acts.autocast_weight_copies else ""
    )
    peak_while = (
        "while the loss is computed"
        if acts.loss_transient >= acts.recompute_working_set
        else "while a recomputed chunk is rebuilt"
    )
    sharding = (
        "FSDP2 (weights, grads, optimizer / dp)"
        if lay.use_torch_fsdp2
        else ("distributed optimizer" if lay.use_distributed_optimizer else "replicated optimizer")
    )
    pipeline = ""
    if pp > 1:
        vpp = lay.virtual_pipeline_model_parallel_size
        pipeline = f" (pipeline schedule {lay.parallel_config().schedule}" + (
            f", {vpp} virtual stages per rank)" if vpp > 1 else ")"
        )
    # A stage without the loss (and without recompute) peaks when its forwards hold the most: no transient.
    transient = (
        f"+ {format_bytes(acts.peak - acts.held_after_forward)} {peak_while}; "
        if acts.peak > acts.held_after_forward or pp == 1
        else ""
    )
    if pp == 1:
        held = (
            f"held for backward: {acts.microbatches_in_flight} microbatch(es) x "
            f"{format_bytes(acts.embedding + acts.layers + acts.output)}{copies}"
        )
    else:
        unit = "chunk-microbatch(es)" if len(acts.chunks) > 1 else "microbatch(es)"
        in_flight = acts.held_after_forward - acts.pipeline_buffers - acts.autocast_weight_copies
        held = (
            f"held for backward: {format_bytes(in_flight)} by up to {acts.microbatches_in_flight} {unit} in "
            f"flight + {format_bytes(acts.pipeline_buffers)} pipeline send buffers{copies}"
        )
    context = f" x cp {cp}" if cp > 1 else ""
    moe = acts.per_moe_layer > 0
    experts = (
        f"; experts: {world // pp} ranks per stage = etp {lay.etp_size} x ep {lay.expert_model_parallel_size} x edp "
        f"{lay.expert_data_parallel_size}"
        if moe
        else ""
    )
    tokens_per_rank = f" ({lay.local_seq_length} tokens per rank, K/V exchange {lay.cp_comm_type})" if cp > 1 else ""
    rows = [
        f"layout: {world} ranks = tp {lay.tensor_model_parallel_size}{context} x pp {pp} x dp "
        f"{lay.data_parallel_size}{pipeline}{experts}; sequence_parallel={lay.sequence_parallel}, "
        f"precision={lay.precision}, {sharding}",
        f"microbatch: {lay.micro_batch_size} sequences, seq_length={lay.seq_length}{tokens_per_rank}, "
        f"microbatches/step={lay.num_microbatches}, kernels of {lay.device_type}",
        f"per rank (pipeline stage {estimate.pipeline_stage}{', the most loaded' if pp > 1 else ''}):",
        f"  parameters               {estimate.params:>16,}   (model: {estimate.model_params:,}"
        + (
            f", active per token: {estimate.model_active_params:,}; this rank's experts: {estimate.expert_params:,})"
            if moe
            else ")"
        ),
    ]
    if lay.lora is not None:
        rows.append(
            f"  of which trainable       {estimate.trainable_params:>16,}   (LoRA dim {lay.lora.dim} on "
            f"{', '.join(lay.lora.target_modules)}; the base is frozen: gradients and optimizer state are the "
            f"adapters')"
        )
    rows += [
        f"  weights                  {format_bytes(estimate.weights_bytes):>16}",
        f"  gradients                {format_bytes(estimate.grads_bytes):>16}",
        f"  optimizer state          {format_bytes(estimate.optimizer_bytes):>16}   (without distributed optimizer "
        f"{format_bytes(estimate.optimizer_bytes_replicated)}, "
        f"with {format_bytes(estimate.optimizer_bytes_distributed)})",
        f"  activations (peak)       {format_bytes(estimate.activation_bytes):>16}   ({held}; {transient}"
        f"{recompute_note})",
    ]
    if moe:
        rows.append(
            f"  of which per MoE layer   {format_bytes(acts.per_moe_layer):>16}   (per microbatch; balanced routing "
            f"assumed: a dropless layer's expert loads depend on the data; + "
            f"{format_bytes(acts.moe_dispatch_transient)} while its dispatcher moves the tokens)"
        )
    if estimate.fsdp_unsharded_bytes:
        rows.append(f"  FSDP2 all-gathered       {format_bytes(estimate.fsdp_unsharded_bytes):>16}")
    if estimate.frozen_bytes:
        rows.append(f"  frozen reference model   {format_bytes(estimate.frozen_bytes):>16}")
    rows.append(f"  total                    {format_bytes(estimate.total_bytes):>16}")
    if len(estimate.stages) > 1:
        rows += format_stages(estimate)
    if flops_per_step is not None:
        rows.append(f"FLOPs per step: {flops_per_step:.3e} (model), {flops_per_step / world:.3e} per rank")
    return "\n".join(rows)


def _layer_ranges(layers: list) -> str:
    """``[0, 1, 2, 6, 7]`` -> ``0-2,6-7``; no layers -> ``-``."""
    spans: list = []
    for i in layers:
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in spans) or "-"


def format_stages(estimate: MemoryEstimate) -> list:
    """One line per pipeline stage of ``estimate.stages`` (a rank of each), the most loaded one marked."""
    head = (
        f"  {'stage':<5} {'layers':<12} {'parameters':>12} {'weights':>11} {'gradients':>11} {'optimizer':>11} "
        f"{'activations':>11} {'in flight':>9} {'total':>11}"
    )
    rows = ["per pipeline stage (activations: peak; in flight: (chunk-)microbatches held at once):", head]
    for stage in estimate.stages:
        mark = "  <- most loaded" if stage.pipeline_stage == estimate.pipeline_stage else ""
        rows.append(
            f"  {stage.pipeline_stage:<5} {_layer_ranges(stage.layers):<12} {stage.params:>12,} "
            f"{format_bytes(stage.weights_bytes):>11} {format_bytes(stage.grads_bytes):>11} "
            f"{format_bytes(stage.optimizer_bytes):>11} {format_bytes(stage.activation_bytes):>11} "
            f"{stage.activations.microbatches_in_flight:>9} {format_bytes(stage.total_bytes):>11}{mark}"
        )
    return rows


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
    return (
        f"WARNING: the estimated per-rank total {format_bytes(estimate.total_bytes)} exceeds the device memory "
        f"{format_bytes(device_memory_bytes)}; raise tensor_model_parallel_size, turn on sequence_parallel, the "
        f"distributed optimizer or activation recompute, or lower micro_batch_size"
    )

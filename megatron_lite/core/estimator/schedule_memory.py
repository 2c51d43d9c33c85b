"""The activations one pipeline rank holds across a training step's schedule: walk the order of forwards
and backwards the executor runs over the per-microbatch bytes of each model chunk."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class ChunkActivations:
    """Activation bytes of one model chunk (virtual stage) a rank holds, per microbatch it runs."""

    virtual_stage: int
    """Index ``v * P + p`` in the pipeline order."""
    first_layer: int
    """Global index of the chunk's first transformer layer."""
    num_layers: int
    """Transformer layers of the chunk."""
    per_microbatch: int
    """Bytes one microbatch's forward of this chunk keeps until its backward (embedding and output parts
    on the first and last chunk, recompute applied)."""
    sent_output: int = 0
    """Bytes of the activations handed to the next stage (0 on the last chunk): alive at the end of the forward
    and then held by the send until it completes (the schedule keeps only a storage-less stand-in for the
    backward, ``core/parallel/pipeline/deallocate.py``)."""
    sent_grad: int = 0
    """Bytes of the input gradient each backward sends to the previous stage (0 on the first chunk), held by
    the send until it completes."""
    loss_transient: int = 0
    """Extra bytes while this chunk's forward computes the loss (the last chunk only)."""
    attention_peak: int = 0
    """Bytes of one microbatch's forward of this chunk alive while its last layer runs context-parallel
    attention, that attention's keys/values in flight and block scores included (0 without CP)."""
    dispatch_peak: int = 0
    """Bytes of one microbatch's forward of this chunk alive while an MoE layer's dispatcher holds its gathered or
    permuted tokens, those included (0 without MoE layers)."""
    recompute_working_set: int = 0
    """Extra bytes while this chunk's backward rebuilds a recomputed group of layers."""
    in_flight: int = 1
    """Most microbatches of this chunk alive at once (forwards run, backwards not yet) in the schedule."""


@dataclass(frozen=True)
class ScheduleMemory:
    """What walking a schedule's order says about the activations one rank holds (bytes, no weight copies)."""

    held: int
    """The most bytes alive at once: chunk-microbatches between their forward and backward, plus pipeline buffers."""
    peak: int
    """``held`` at the worst moment plus that moment's transient (a loss computation, a rebuilt recompute group)."""
    buffers_when_held: int
    """Pipeline send buffers alive when ``held`` is reached (the last action's sends and the current one's)."""
    in_flight: int
    """Most chunk-microbatches alive at once."""
    in_flight_per_chunk: tuple
    """Most microbatches alive at once, per chunk."""


def schedule_memory(order: list, chunks: list) -> ScheduleMemory:
    """Walk ``order`` (the schedule's ``(kind, chunk, microbatch)`` actions on one rank) over ``chunks``
    (:class:`ChunkActivations`); sets each chunk's ``in_flight``.

    A forward adds its chunk's per-microbatch bytes, freed by the matching backward. Two things of
    ``run_pipeline`` (core/parallel/pipeline/schedules.py) are counted as they are measured:

    * sends are posted asynchronously, each holding its tensor (an output sent forward, a gradient sent
      back) until the transfer completes (``PipelineP2P.release_completed``); a transfer completes once
      the neighbour has posted its receive, which the executor posts ahead, at the start of the action
      before the one that needs it. Counted: what this action sends and what the previous action sent
      (its transfer may still run while this one computes); older sends are done. Measured exact under
      1F1B and GPipe; the interleaved schedule's neighbours can post later (its warm-up runs more
      forwards), leaving a few more ``s b h`` send buffers alive than counted (measured on PP2, V2: two
      more on the last rank).
    * the output a backward started from stays referenced until the next forward returns, its graph
      holding that backward's input activations (``lingering``; measured: one ``s b h`` tensor on
      non-first stages).
    """
    alive = lingering = held = peak = held_buffers = count = most = 0
    sent_before = 0  # bytes the previous action sent, possibly still in transfer
    per_chunk, most_per_chunk = [0] * len(chunks), [0] * len(chunks)
    for kind, index, _ in order:
        chunk: ChunkActivations = chunks[index]
        if kind == "F":
            alive += chunk.per_microbatch
            buffers = sent_before + chunk.sent_output
            count, per_chunk[index] = count + 1, per_chunk[index] + 1
            most, most_per_chunk[index] = max(most, count), max(most_per_chunk[index], per_chunk[index])
            peak = max(
                peak,
                alive + buffers + lingering + chunk.loss_transient,
                alive - chunk.per_microbatch + buffers + lingering + chunk.attention_peak,
                alive - chunk.per_microbatch + buffers + lingering + chunk.dispatch_peak,
            )
            now = alive + buffers + lingering  # at the end of the forward, before the last backward's output is let go
            lingering, sent_before = 0, chunk.sent_output
        else:
            lingering = 0  # the schedule takes this backward's input and output in place of the last ones
            peak = max(peak, alive + sent_before + chunk.recompute_working_set)
            alive -= chunk.per_microbatch
            buffers = sent_before + chunk.sent_grad
            lingering = chunk.sent_grad  # the input: same bytes as its gradient, 0 on the first chunk
            count, per_chunk[index] = count - 1, per_chunk[index] - 1
            now = alive + buffers + lingering
            sent_before = chunk.sent_grad
        if now > held:
            held, held_buffers = now, buffers
    for chunk, n in zip(chunks, most_per_chunk):
        chunk.in_flight = n
    return ScheduleMemory(
        held=held,
        peak=max(peak, held),
        buffers_when_held=held_buffers,
        in_flight=most,
        in_flight_per_chunk=tuple(most_per_chunk),
    )

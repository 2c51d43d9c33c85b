"""Checks of a run's parallel configuration that run before any process group or weight exists."""
from __future__ import annotations

from collections.abc import Sequence
from typing import Optional

from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.microbatches import build_num_microbatches_calculator


def validate_run(parallel: ParallelConfig, world_size: int, model_config=None, micro_batch_size: Optional[int] = None,
                 global_batch_size: Optional[int] = None, seq_length: Optional[int] = None,
                 rampup_batch_size: Optional[Sequence[int]] = None, use_torch_fsdp2: bool = False) -> int:
    """Validate sizes against the world, the model and the batch geometry (every batch of a ramp-up
    ``[start, increment, rampup_samples]`` included) and context parallelism against the model, the
    data and FSDP2; return the DP size.

    Every failure is a ValueError whose message says what to change.
    """
    dp = parallel.data_parallel_size(world_size)
    check_context_parallel(parallel, model_config, seq_length, use_torch_fsdp2)
    if model_config is not None:
        model_config.validate_parallelism(parallel.tensor_model_parallel_size, parallel.pipeline_model_parallel_size,
                                          parallel.context_parallel_size, parallel.sequence_parallel)
        parallel.stage_chunks(model_config.num_layers, 0)  # the layers split into the pipeline stages
    if micro_batch_size is not None and global_batch_size is not None:
        if global_batch_size % (micro_batch_size * dp) != 0:
            unit = micro_batch_size * dp
            raise ValueError(
                f"global_batch_size ({global_batch_size}) must be divisible by micro_batch_size ({micro_batch_size}) "
                f"x data-parallel size ({dp}) = {unit}; set global_batch_size to a multiple of {unit} "
                f"(e.g. {max(unit, global_batch_size // unit * unit)}) or change micro_batch_size / the device count.")
        if rampup_batch_size is not None:
            build_num_microbatches_calculator(global_batch_size, micro_batch_size, dp, rampup_batch_size)
        if parallel.schedule == "interleaved_1f1b":
            _check_interleaved_microbatches(parallel, micro_batch_size, dp, global_batch_size, rampup_batch_size)
    if model_config is not None and seq_length is not None:
        check_seq_length(seq_length, model_config)
    if (model_config is not None and seq_length is not None and parallel.sequence_parallel
            and seq_length % parallel.tensor_model_parallel_size):
        raise ValueError(
            f"the data's seq_length ({seq_length}) must be divisible by tensor_model_parallel_size "
            f"({parallel.tensor_model_parallel_size}) with sequence_parallel=True.")
    return dp


def check_context_parallel(parallel: ParallelConfig, model_config=None, seq_length: Optional[int] = None,
                           use_torch_fsdp2: bool = False) -> None:
    """Refuse context parallelism where it cannot run exactly: sequences that do not cut into ``2 x C``
    equal chunks (the model's and the data's), a local length ``s / C`` that sequence parallelism cannot
    split over TP, attention dropout (the blockwise CP attention has none) and FSDP2 (not composed)."""
    cp = parallel.context_parallel_size
    if cp == 1:
        return
    tp = parallel.tensor_model_parallel_size
    lengths = []
    if model_config is not None:
        lengths.append(("GPTConfig.seq_length", model_config.seq_length))
    if seq_length is not None:
        lengths.append(("the data's seq_length", seq_length))
    for name, length in lengths:
        if length % (2 * cp):
            multiple = 2 * cp * (tp if parallel.sequence_parallel else 1)
            raise ValueError(
                f"{name} ({length}) must be divisible by 2 x context_parallel_size = {2 * cp} (each sequence is cut "
                f"into {2 * cp} chunks, rank r holding chunks r and {2 * cp - 1}-r); set seq_length to a multiple of "
                f"{multiple} (e.g. {max(multiple, length // multiple * multiple)}) or change context_parallel_size.")
        if parallel.sequence_parallel and (length // cp) % tp:
            multiple = 2 * cp * tp
            raise ValueError(
                f"{name} ({length}) over context_parallel_size ({cp}) leaves {length // cp} tokens per rank, which "
                f"sequence_parallel=True cannot split over tensor_model_parallel_size ({tp}); set seq_length to a "
                f"multiple of 2 x context_parallel_size x tensor_model_parallel_size = {multiple} (e.g. "
                f"{max(multiple, length // multiple * multiple)}) or set sequence_parallel=False.")
    if model_config is not None and getattr(model_config, "attention_dropout", 0.0) > 0:
        raise ValueError(
            f"attention_dropout={model_config.attention_dropout} with context_parallel_size={cp}: context-parallel "
            f"attention merges blockwise softmax results and applies no dropout to the probabilities; set "
            f"GPTConfig(attention_dropout=0.0) (hidden_dropout is fine) or context_parallel_size=1.")
    if use_torch_fsdp2:
        raise ValueError(
            f"use_torch_fsdp2=True with context_parallel_size={cp} is not composed yet (FSDP2 would shard over the "
            f"data-parallel ranks only, while gradients must be reduced over data x context parallel ranks); use the "
            f"distributed optimizer, OptimizerConfig(use_distributed_optimizer=True), with context parallelism.")


def _check_interleaved_microbatches(parallel: ParallelConfig, micro_batch_size: int, dp: int, global_batch_size: int,
                                    rampup_batch_size: Optional[Sequence[int]]) -> None:
    """Megatron's interleaved schedule runs microbatches in groups of pipeline_model_parallel_size."""
    pp = parallel.pipeline_model_parallel_size
    sizes = [global_batch_size]
    if rampup_batch_size is not None:
        start, increment, _ = rampup_batch_size
        sizes = list(range(start, global_batch_size + 1, increment)) + [global_batch_size]
    for size in sizes:
        microbatches = size // (micro_batch_size * dp)
        if microbatches % pp:
            raise ValueError(
                f"the interleaved pipeline schedule needs the number of microbatches per step to be a multiple of "
                f"pipeline_model_parallel_size ({pp}), got {microbatches} (global batch {size} / (micro_batch_size "
                f"{micro_batch_size} x dp {dp})); set global_batch_size to a multiple of {micro_batch_size * dp * pp} "
                f"(and so every ramp-up size) or use pipeline_schedule='1f1b'.")


def check_seq_length(seq_length: int, model_config) -> None:
    """Refuse data sequences longer than the model takes: ``max(seq_length, max_position_embeddings)``
    of its config (a shorter data ``seq_length`` is fine).

    A learned position table has no row past ``max_position_embeddings``. RoPE would run at any length,
    but silently: it extrapolates past what the model was configured for, and the FLOPs and memory
    estimates and the parallel checks read the model's ``seq_length``. Megatron has one ``--seq-length``
    for both sides; here the longer length must be asked for on the model too.
    """
    longest = max(model_config.seq_length, model_config.max_position_embeddings)
    if seq_length <= longest:
        return
    if model_config.position_embedding_type == "learned_absolute":
        raise ValueError(
            f"the data's seq_length ({seq_length}) is longer than the model's learned position table "
            f"(GPTConfig.max_position_embeddings={model_config.max_position_embeddings}, "
            f"GPTConfig.seq_length={model_config.seq_length}); set the datamodule's seq_length to at most "
            f"{longest}, or GPTConfig(seq_length={seq_length}) (and max_position_embeddings >= {seq_length}).")
    raise ValueError(
        f"the data's seq_length ({seq_length}) is longer than the model's GPTConfig.seq_length "
        f"({model_config.seq_length}) and GPTConfig.max_position_embeddings ({model_config.max_position_embeddings}), "
        f"so RoPE would run at positions the model is not configured for; set GPTConfig(seq_length={seq_length}) "
        f"or the datamodule's seq_length to at most {longest}.")

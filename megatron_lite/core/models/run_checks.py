"""Checks of a run against its model that run before any process group or weight exists (those that need no
model are :class:`~megatron_lite.core.parallel.run_spec.RunSpec`'s). They read the model's config, so they sit with
the models, above the parallel layer they check against."""

from __future__ import annotations

from typing import Any, Optional

from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe_config import check_moe_parallelism
from megatron_lite.core.parallel.layout import ParallelConfig
from megatron_lite.core.parallel.pipeline_stages import pipeline_layout_mtp_layers
from megatron_lite.core.parallel.run_spec import RunSpec


def check_run_fits_model(run: RunSpec, model_config: Optional[GPTConfig] = None) -> None:
    """What :class:`RunSpec` cannot check alone: the model (a GPTConfig, or None when the module has none) and
    the data's sequences against the layout -- context parallelism, heads and groups over TP, layers into the
    pipeline stages, the data's ``seq_length`` against the model and under sequence parallelism.

    Every failure is a ValueError whose message says what to change.
    """
    parallel = run.parallel
    seq_length = run.data.seq_length if run.data is not None else None
    check_context_parallel(parallel, model_config, seq_length)
    if model_config is None:
        if parallel.expert_model_parallel_size > 1 or parallel.expert_tensor_parallel_size is not None:
            raise ValueError(
                "expert_model_parallel_size / expert_tensor_parallel_size split the experts of an MoE model, and "
                "this module has no GPTConfig with num_moe_experts: leave them at their defaults."
            )
        return
    model_config.validate_parallelism(
        parallel.tensor_model_parallel_size,
        parallel.pipeline_model_parallel_size,
        parallel.context_parallel_size,
        parallel.sequence_parallel,
    )
    parallel.stage_chunks(model_config.num_layers, 0)  # the layers split into the pipeline stages
    check_layout_mtp_layers(parallel, model_config)
    check_moe_parallelism(model_config, parallel)
    if seq_length is None:
        return
    check_seq_length(seq_length, model_config)
    if parallel.sequence_parallel and seq_length % parallel.tensor_model_parallel_size:
        raise ValueError(
            f"the data's seq_length ({seq_length}) must be divisible by tensor_model_parallel_size "
            f"({parallel.tensor_model_parallel_size}) with sequence_parallel=True."
        )


def check_layout_mtp_layers(parallel: ParallelConfig, model_config: GPTConfig) -> None:
    """A ``pipeline_model_parallel_layout`` that names multi-token prediction layers ('m', as Megatron's layouts of
    DeepSeek-V3 do) must name as many as the model has (``mtp_num_layers``); one that names none is fine (the block
    always sits on the last stage)."""
    layout = parallel.pipeline_model_parallel_layout
    placed = 0 if layout is None else pipeline_layout_mtp_layers(layout)
    depth = model_config.mtp_num_layers or 0
    if placed and placed != depth:
        raise ValueError(
            f"pipeline_model_parallel_layout {layout!r} places {placed} multi-token prediction layer(s) ('m'), but the "
            f"model has mtp_num_layers={model_config.mtp_num_layers}; put {depth} 'm' before the final 'L' (or none) "
            f"or set mtp_num_layers={placed}."
        )


def check_context_parallel(
    parallel: ParallelConfig, model_config: Any = None, seq_length: Optional[int] = None
) -> None:
    """Refuse context parallelism where it cannot run exactly: sequences that do not cut into ``2 x C``
    equal chunks (the model's and the data's), a local length ``s / C`` that sequence parallelism cannot
    split over TP and attention dropout (the blockwise CP attention has none); FSDP2 is refused by the
    :class:`RunSpec`."""
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
                f"{multiple} (e.g. {max(multiple, length // multiple * multiple)}) or change context_parallel_size."
            )
        if parallel.sequence_parallel and (length // cp) % tp:
            multiple = 2 * cp * tp
            raise ValueError(
                f"{name} ({length}) over context_parallel_size ({cp}) leaves {length // cp} tokens per rank, which "
                f"sequence_parallel=True cannot split over tensor_model_parallel_size ({tp}); set seq_length to a "
                f"multiple of 2 x context_parallel_size x tensor_model_parallel_size = {multiple} (e.g. "
                f"{max(multiple, length // multiple * multiple)}) or set sequence_parallel=False."
            )
    if model_config is not None and getattr(model_config, "attention_dropout", 0.0) > 0:
        raise ValueError(
            f"attention_dropout={model_config.attention_dropout} with context_parallel_size={cp}: context-parallel "
            f"attention merges blockwise softmax results and applies no dropout to the probabilities; set "
            f"GPTConfig(attention_dropout=0.0) (hidden_dropout is fine) or context_parallel_size=1."
        )


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
            f"{longest}, or GPTConfig(seq_length={seq_length}) (and max_position_embeddings >= {seq_length})."
        )
    raise ValueError(
        f"the data's seq_length ({seq_length}) is longer than the model's GPTConfig.seq_length "
        f"({model_config.seq_length}) and GPTConfig.max_position_embeddings ({model_config.max_position_embeddings}), "
        f"so RoPE would run at positions the model is not configured for; set GPTConfig(seq_length={seq_length}) "
        f"or the datamodule's seq_length to at most {longest}."
    )

"""How a model's layers are cut into pipeline stages (and virtual stages).

Virtual stage ``s = v * P + p`` is chunk ``v`` of pipeline rank ``p`` (Megatron's interleaved
order): the layers are dealt out in that order, so consecutive virtual stages live on consecutive
ranks and activations travel around the pipeline ring V times. The V-shaped zero-bubble schedules place a rank's
two chunks in a V instead (:data:`V_SHAPED_SCHEDULES`). The first virtual stage holds the
embedding, the last the final norm, the output layer and the loss.

The layer counts of the virtual stages come from one of three cuts: even, uneven (fixed first/last stage counts) or
Megatron's ``pipeline_model_parallel_layout`` (each stage's layers spelled out), parsed here once into counts.

The cut and the schedule names are part of the parallel configuration (``ParallelConfig`` validates and cuts
with them), so they live below ``layout``, outside ``pipeline/``: the pipeline's runtime (transfers, schedules)
is built on the layout.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Optional, Union

PIPELINE_SCHEDULES = ("1f1b", "interleaved_1f1b", "gpipe", "zb1p", "zbv", "dualpipev")
V_SHAPED_SCHEDULES = ("zbv", "dualpipev")
"""Schedules that place a rank's two chunks in a V: chunk 0 of rank ``p`` is virtual stage ``p``, chunk 1 is
``2P - 1 - p`` (the first and last stage on rank 0, the turn on rank ``P - 1``)."""


def virtual_stage_of(chunk: int, pp_rank: int, pp: int, v_shape: bool = False) -> int:
    """The virtual stage of model chunk ``chunk`` of pipeline rank ``pp_rank``."""
    if v_shape:
        return pp_rank if chunk == 0 else 2 * pp - 1 - pp_rank
    return chunk * pp + pp_rank


def stage_pp_rank(virtual_stage: int, pp: int, v_shape: bool = False) -> int:
    """The pipeline rank that holds ``virtual_stage``."""
    if v_shape:
        return virtual_stage if virtual_stage < pp else 2 * pp - 1 - virtual_stage
    return virtual_stage % pp


PipelineLayout = Union[str, Sequence[Sequence[str]]]
"""Megatron's ``pipeline_model_parallel_layout``: a string such as ``"Et*3|(tt|)*2,L"`` or one list of layer names
(``"embedding"``, ``"decoder"``, ``"loss"``) per virtual stage."""

# Megatron's letters in a layout string, and the LayerType names they stand for (the names of the list form).
_LAYOUT_LETTERS = {"E": "embedding", "t": "decoder", "L": "loss", "m": "mtp"}
# megatron-core's parse_str_to_list, in its order: a group ``(...)*N`` is unrolled first, then a letter's ``x*N``.
_LAYOUT_REPEATS = (r"\(([^)]+)\)\*(\d+)", r"(.)\*(\d+)")
_LAYOUT_GRAMMAR = (
    "E (embedding), t (transformer layer), m (multi-token prediction layer, in the last stage), L (loss), '|' "
    "between virtual stages, x*N or (...)*N to repeat, commas ignored"
)


@dataclass(frozen=True)
class StageChunk:
    """One (virtual) pipeline stage held by a rank."""

    virtual_stage: int
    """Index ``v * P + p`` in the pipeline order."""
    num_virtual_stages: int
    """``P * V``: how many virtual stages the model is cut into."""
    layers: range
    """Global indices of the transformer layers of this chunk."""

    @property
    def pre_process(self) -> bool:
        """Whether this chunk holds the embedding (the first virtual stage)."""
        return self.virtual_stage == 0

    @property
    def post_process(self) -> bool:
        """Whether this chunk holds the output layer and the loss (the last virtual stage)."""
        return self.virtual_stage == self.num_virtual_stages - 1


def parse_pipeline_layout(layout: PipelineLayout) -> list[list[str]]:
    """The layer names of each virtual stage of ``layout``, in pipeline order, read as megatron-core reads it
    (``PipelineParallelLayerLayout``); a ValueError names the fix. Multi-token prediction layers ('m') may only sit
    in the last virtual stage, before the loss (where our MTP block lives, beside the output layer it shares);
    :func:`pipeline_layout_mtp_layers` counts them."""
    if isinstance(layout, str):
        text = layout.replace(",", "")
        for pattern in _LAYOUT_REPEATS:
            text = re.sub(pattern, lambda match: match.group(1) * int(match.group(2)), text)
        stages = []
        for letters in text.split("|"):
            unknown = [letter for letter in letters if letter not in _LAYOUT_LETTERS]
            if unknown:
                raise ValueError(
                    f"pipeline_model_parallel_layout {layout!r}: {unknown[0]!r} is not part of the layout grammar "
                    f"(a group in parentheses needs *N and groups do not nest); use {_LAYOUT_GRAMMAR}."
                )
            stages.append([_LAYOUT_LETTERS[letter] for letter in letters])
    elif isinstance(layout, Sequence) and all(
        isinstance(stage, Sequence) and not isinstance(stage, str) for stage in layout
    ):
        stages = []
        for stage in layout:
            found = [name.strip().lower() if isinstance(name, str) else name for name in stage]
            unknown = [name for name in found if name not in _LAYOUT_LETTERS.values()]
            if unknown:
                raise ValueError(
                    f"pipeline_model_parallel_layout: {unknown[0]!r} is not a layer name; use 'embedding', 'decoder' "
                    f"(a transformer layer), 'mtp' and 'loss' in each virtual stage's list."
                )
            stages.append(found)
    else:
        raise ValueError(
            f"pipeline_model_parallel_layout must be a string such as 'E|tt|tt|L' or a list of lists of layer "
            f"names (one list per virtual stage), got {layout!r}."
        )
    misplaced = any("mtp" in stage for stage in stages[:-1]) or (
        "mtp" in stages[-1] and stages[-1][stages[-1].index("mtp") :] != ["mtp"] * stages[-1].count("mtp") + ["loss"]
    )
    if misplaced:
        raise ValueError(
            f"pipeline_model_parallel_layout {layout!r} places multi-token prediction layers ('m') away from the "
            f"loss: megatron-lite's MTP block always sits on the last pipeline stage, right before the loss; put "
            f"every 'm' at the end of the last stage ('...|tmL') or leave them out (the block goes there anyway)."
        )
    return stages


def pipeline_layout_mtp_layers(layout: PipelineLayout) -> int:
    """How many multi-token prediction layers ('m') ``layout`` places (0 when it names none)."""
    return sum(stage.count("mtp") for stage in parse_pipeline_layout(layout))


def pipeline_layout_counts(layout: PipelineLayout, pp: int, vpp: int) -> tuple[int, ...]:
    """Transformer layers of each of the ``pp * vpp`` virtual stages of ``layout`` (in pipeline order, ``v * P + p``),
    or a ValueError naming the fix: the embedding opens the first virtual stage and the loss closes the last, each
    once (as megatron-core requires); the other stages may hold any number of layers, none included."""
    stages = parse_pipeline_layout(layout)
    if len(stages) != pp * vpp:
        fix = (
            f"set virtual_pipeline_model_parallel_size={len(stages) // pp}"
            if len(stages) % pp == 0
            else f"give it a multiple of pipeline_model_parallel_size ({pp}) stages"
        )
        raise ValueError(
            f"pipeline_model_parallel_layout {layout!r} has {len(stages)} virtual stage(s), but "
            f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size = {pp} x {vpp} = {pp * vpp}; "
            f"{fix} or change the layout's '|'-separated stages."
        )
    flat = [name for stage in stages for name in stage]
    if flat.count("embedding") != 1 or stages[0][:1] != ["embedding"]:
        raise ValueError(
            f"pipeline_model_parallel_layout {layout!r}: the embedding 'E' must open the first virtual stage and "
            f"appear nowhere else (e.g. 'Et|tt|tL')."
        )
    if flat.count("loss") != 1 or stages[-1][-1:] != ["loss"]:
        raise ValueError(
            f"pipeline_model_parallel_layout {layout!r}: the loss 'L' must close the last virtual stage and appear "
            f"nowhere else (e.g. 'Et|tt|tL')."
        )
    return tuple(stage.count("decoder") for stage in stages)


def layers_per_virtual_stage(
    num_layers: int,
    pp: int,
    vpp: int = 1,
    first: Optional[int] = None,
    last: Optional[int] = None,
    layout_counts: Optional[Sequence[int]] = None,
) -> list[int]:
    """Layer counts of the ``pp * vpp`` virtual stages, in pipeline order; a ValueError names the fix.

    ``first``/``last`` (Megatron's ``num_layers_in_first/last_pipeline_stage``) fix the first and last
    stage's layer counts; the others share the rest evenly. ``layout_counts`` (a layout's
    :func:`pipeline_layout_counts`) gives every stage's count instead.
    """
    stages = pp * vpp
    if layout_counts is not None:
        if first is not None or last is not None or len(layout_counts) != stages:
            raise ValueError(
                "a pipeline_model_parallel_layout replaces num_layers_in_first/last_pipeline_stage and must have "
                "pipeline_model_parallel_size x virtual_pipeline_model_parallel_size stages; set one cut only."
            )
        if sum(layout_counts) != num_layers:
            raise ValueError(
                f"pipeline_model_parallel_layout holds {sum(layout_counts)} transformer layers ('t'), but num_layers "
                f"is {num_layers}; make them equal."
            )
        return list(layout_counts)
    if (first is not None or last is not None) and vpp > 1:
        raise ValueError(
            "num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage are supported without "
            "virtual pipeline stages only; drop virtual_pipeline_model_parallel_size or the uneven cut."
        )
    if (first is not None or last is not None) and pp == 1:
        raise ValueError("num_layers_in_first/last_pipeline_stage need pipeline_model_parallel_size > 1.")
    for name, value in (("num_layers_in_first_pipeline_stage", first), ("num_layers_in_last_pipeline_stage", last)):
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ValueError(f"{name} must be a non-negative integer, got {value!r}")
    if first is None and last is None:
        if num_layers % stages:
            what = (
                f"pipeline_model_parallel_size ({pp})"
                if vpp == 1
                else f"pipeline_model_parallel_size x virtual_pipeline_model_parallel_size ({pp} x {vpp} = {stages})"
            )
            raise ValueError(
                f"num_layers ({num_layers}) must be divisible by {what}; change num_layers or the pipeline sizes, "
                f"or cut unevenly with num_layers_in_first_pipeline_stage / num_layers_in_last_pipeline_stage."
            )
        return [num_layers // stages] * stages
    fixed = (first or 0) + (last or 0)
    middle = pp - (first is not None) - (last is not None)
    rest = num_layers - fixed
    if rest < 0 or (middle == 0 and rest != 0) or (middle > 0 and rest % middle):
        raise ValueError(
            f"num_layers ({num_layers}) minus the first/last stage's layers ({fixed}) must split evenly over the "
            f"{middle} other pipeline stage(s); change num_layers_in_first/last_pipeline_stage."
        )
    even = rest // middle if middle else 0
    counts = [even] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def stage_chunks(
    num_layers: int,
    pp: int,
    pp_rank: int,
    vpp: int = 1,
    first: Optional[int] = None,
    last: Optional[int] = None,
    layout_counts: Optional[Sequence[int]] = None,
    v_shape: bool = False,
) -> list[StageChunk]:
    """The chunks (virtual stages) pipeline rank ``pp_rank`` holds, in chunk order ``v = 0 .. V-1`` (placed in a V
    with ``v_shape``: :data:`V_SHAPED_SCHEDULES`)."""
    counts = layers_per_virtual_stage(num_layers, pp, vpp, first, last, layout_counts)
    starts = [sum(counts[:s]) for s in range(len(counts))]
    chunks = []
    for v in range(vpp):
        s = virtual_stage_of(v, pp_rank, pp, v_shape)
        chunks.append(StageChunk(s, pp * vpp, range(starts[s], starts[s] + counts[s])))
    return chunks

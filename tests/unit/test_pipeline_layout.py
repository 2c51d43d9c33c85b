"""``pipeline_model_parallel_layout`` read as megatron-core, the library that defines the format, reads it.

megatron-core parses a layout where ``TransformerConfig`` is built (``PipelineParallelLayerLayout``, the virtual
pipeline size detected from it) and its model code asks the parsed layout for each (pipeline rank, virtual stage)'s
layer ids. For each layout ours must give the same layers on every chunk, the embedding and the loss on the same
chunks, and the same virtual pipeline size; where megatron-core refuses a layout, so do we.
"""

from __future__ import annotations

import warnings

import pytest
import torch

from megatron_lite.core.parallel.layout import ParallelConfig


@pytest.fixture(scope="module")
def megatron(megatron_core):
    return (
        megatron_core("megatron.core.parallel_state"),
        megatron_core("megatron.core.transformer.enums").LayerType,
        megatron_core("megatron.core.transformer.transformer_config").TransformerConfig,
    )


def _megatron_config(megatron, layout, pp: int, num_layers: int):
    _, _, TransformerConfig = megatron
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # its deprecation notices about options we do not set
        return TransformerConfig(
            num_layers=num_layers,
            hidden_size=8,
            num_attention_heads=2,
            pipeline_model_parallel_size=pp,
            pipeline_dtype=torch.float32,
            pipeline_model_parallel_layout=layout,
        )


@pytest.mark.parametrize(
    "layout, pp, num_layers",
    [
        ("E|tt|tt|L", 2, 4),  # the embedding and the loss alone on the end stages, interleaved
        ("Et*3|(tt|)*2,L", 2, 7),  # repetition of a letter and of a group, a cosmetic comma
        ("E|(t*2|)*2,L", 2, 4),  # a repeated letter inside a repeated group
        ("Ett|(tt|)*3,tL", 5, 9),  # five ranks, one stage each
        ("E|t*4|t*4|L", 4, 8),
        ("Et||tt|L", 2, 3),  # an empty middle stage
        ([["embedding", "decoder"], ["decoder"], ["Decoder "], ["decoder", "loss"]], 2, 4),  # the list form
    ],
)
def test_layer_ids_per_chunk_equal_megatron_core(megatron, layout, pp, num_layers):
    parallel_state, LayerType, _ = megatron
    theirs = _megatron_config(megatron, layout, pp, num_layers)
    vpp = theirs.virtual_pipeline_model_parallel_size or 1
    ours = ParallelConfig(
        pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=vpp, pipeline_model_parallel_layout=layout
    )
    parsed = theirs.pipeline_model_parallel_layout
    # megatron-core's model code asks per virtual stage only when its virtual pipeline size is set (by
    # initialize_model_parallel); set it as that does, and put back what was there.
    before = parallel_state.get_virtual_pipeline_model_parallel_world_size()
    parallel_state.set_virtual_pipeline_model_parallel_world_size(vpp if vpp > 1 else None)
    try:
        for rank in range(pp):
            for chunk, stage in enumerate(ours.stage_chunks(num_layers, rank)):
                assert list(stage.layers) == parsed.get_layer_id_list(vp_stage=chunk, pp_rank=rank), (rank, chunk)
                assert stage.pre_process == (LayerType.embedding in parsed.layout[rank][chunk]), (rank, chunk)
                assert stage.post_process == (LayerType.loss in parsed.layout[rank][chunk]), (rank, chunk)
    finally:
        parallel_state.set_virtual_pipeline_model_parallel_world_size(before)


@pytest.mark.parametrize(
    "layout, num_layers",
    [
        ("tE|tL", 2),  # the embedding must open the first stage
        ("Et|tt", 3),  # no loss
        ("EtL|tL", 2),  # two losses
        ("Et|Lt", 2),  # the loss must close the last stage
        ("Et|t(t)L", 3),  # a group without *N
        ("Et|tL", 3),  # two layers for a 3-layer model
    ],
)
def test_layouts_megatron_core_refuses_are_refused(megatron, layout, num_layers):
    with pytest.raises((AssertionError, ValueError)):
        _megatron_config(megatron, layout, 2, num_layers)
    with pytest.raises(ValueError, match="pipeline_model_parallel_layout"):
        ParallelConfig(pipeline_model_parallel_size=2, pipeline_model_parallel_layout=layout).stage_chunks(
            num_layers, 0
        )

"""Activation bytes of the multi-token prediction block (``core/models/mtp.py``) on the last pipeline stage: what
each depth keeps for backward on one rank for one microbatch, beside the main model's output layer.

Per depth k (``T`` the tokens of a microbatch, ``L`` the rank's sequence-parallel share), in forward order:

* the embedding of the tokens shifted by k (a new id tensor its lookup keeps; with a TP group, the shard-local ids
  and mask as the main embedding's) and its output, which ``enorm`` keeps as its input;
* ``hnorm`` of the previous depth's output (the main model's final-norm output for k = 1): its input is the
  tensor the output layer already keeps unless sequence parallelism gathers a copy for the output layer or
  autocast casts one;
* ``eh_proj``'s input, ``[enorm; hnorm]`` (gathered under SP; a 16-bit copy under autocast);
* the transformer layer, a decoder layer of the model's kind (MoE where the model's last layer is) running on
  ``eh_proj``'s output: under autocast a 16-bit residual stream, whose norms therefore take the mixed-dtype path
  (under SP its input is a slice of the gathered output, which its first norm may keep whole);
* the depth's final norm, the output layer's input and the loss (the fp32 softmax, the targets and their mask, as
  the main output layer's), and the depth's fp32 loss mask.

Under 'full' recompute each depth's norms, projection and layer are one checkpoint that keeps its two inputs (the
shifted tokens' embedding and the previous depth's output) and is rebuilt in the backward; the embedding, the
logits and the loss stay outside it. Checked against the probe on CPU (``tests/unit/test_estimator.py``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from megatron_lite.core.estimator.precision_bytes import KERNEL_SAVES, PRECISION_BYTES, norm_bytes
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.mtp_config import mtp_depth

if TYPE_CHECKING:  # memory.py imports activations.py, which imports this module: the type only
    from megatron_lite.core.estimator.memory import EstimateLayout


def mtp_depth_bytes(config: GPTConfig, layout: "EstimateLayout", layer: int, output: int) -> tuple[int, int]:
    """(kept, rebuilt): the bytes all MTP depths keep for backward on the last stage for one microbatch, with the
    recompute setting applied, and the most one depth's checkpoint rebuilds in the backward beyond what it kept
    (0 without 'full' recompute). ``layer``: the bytes of one depth's transformer layer with its 16-bit residual
    stream; ``output``: what the main output layer keeps after the final norm (its input, softmax, targets)."""
    depths = mtp_depth(config)
    if not depths:
        return 0, 0
    pb = PRECISION_BYTES[layout.precision]
    kernels = layout.kernels or KERNEL_SAVES[layout.device_type]
    c, r, w = pb.compute, pb.residual, pb.weight
    tp, h = layout.tensor_model_parallel_size, config.hidden_size
    tokens = layout.local_seq_length * layout.micro_batch_size
    local = tokens // tp if layout.sequence_parallel else tokens
    ids = tokens * (8 + 1) if layout.world_size > 1 else tokens * 8  # shard-local ids and mask, or the shifted ids
    embedded = local * h * r
    recompute = config.recompute_granularity == "full"
    # Under SP the layer's input is the rank's slice of eh_proj's gathered output, a view: a norm that keeps its
    # input as it is (not RMSNorm's mixed-dtype path) keeps the whole gathered tensor.
    keeps_input = c == w or config.normalization == "LayerNorm"
    sliced = (tokens - local) * h * c if keeps_input else 0
    kept = rebuilt = 0
    for k in range(1, depths + 1):
        # The hidden input: the main final norm's output (residual dtype), then the previous depth's (16-bit: its
        # layer's residual stream). The output layer keeps it as it is unless it gathers (SP) or casts a copy.
        # An RMSNorm of a 16-bit input beside fp32 weights keeps an fp32 copy instead (unless the checkpoint keeps it).
        hidden_bytes = r if k == 1 else c
        copied = hidden_bytes != w and config.normalization == "RMSNorm" and not recompute
        shared = hidden_bytes == c and not layout.sequence_parallel
        hidden = 0 if shared or copied else local * h * hidden_bytes
        norm = config.normalization
        inner = (
            norm_bytes(norm, kernels, local, h, r, w, stored=0)  # enorm (its input: ``embedded``)
            + norm_bytes(norm, kernels, local, h, hidden_bytes, w, stored=0)  # hnorm (its input: ``hidden``)
            + tokens * 2 * h * c  # eh_proj's input
            + layer
            + sliced
            + norm_bytes(norm, kernels, local, h, c, w)  # the depth's final norm, over the layer's output
        )
        outside = ids + embedded + hidden + output + tokens * 4  # + the depth's loss mask
        kept += outside + (0 if recompute else inner)
        rebuilt = max(rebuilt, inner if recompute else 0)
    return kept, rebuilt

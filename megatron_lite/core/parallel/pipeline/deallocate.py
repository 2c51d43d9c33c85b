"""Freeing a pipeline stage's output once it is sent (Megatron's output deallocation).

A non-last stage's output is sent to the next stage and kept only as the root of this stage's backward:
the backward needs its autograd graph (``grad_fn``) and its shape (the gradient received for it has that
shape; the executor posts that receive from the output), never its values. So its storage is swapped for
a single element expanded to the same shape (stride 0): the shape, dtype, device and graph stay, the
``s b h`` bytes go, and ``torch.autograd.backward(out, grad_tensors=grad)`` runs unchanged. Megatron
(``deallocate_output_tensor``) shrinks the output to shape ``(1,)`` instead, and so has to call the
autograd engine without its shape check (``custom_backward``) and carry the shape elsewhere; keeping the
shape needs neither.

The send itself holds its own reference to the original storage (``PipelineP2P`` keeps the sent tensor
until the send completes), so the bytes are released when the send completes, not before.
"""

from __future__ import annotations

import torch


def deallocate_output(out: torch.Tensor) -> None:
    """Free ``out``'s storage (a stage output that has been handed to a send) keeping its shape and graph.

    Left alone: an output with no graph (a forward-only run, a stage that returns its input unchanged),
    whose bytes are either not kept or not its own, and a view, whose bytes belong to its base (freeing
    the view would free nothing)."""
    if out.grad_fn is None or out._base is not None:
        return
    out.data = torch.empty(1, dtype=out.dtype, device=out.device).expand(out.shape)

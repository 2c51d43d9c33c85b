"""Split backward: a linear layer's input gradient now, its weight gradient later (zero-bubble pipelines).

A zero-bubble schedule runs each microbatch's backward in two passes: B, the gradient of the stage's input
(what the previous stage waits for), and W, the gradients of the weights (what nobody waits for, run in the
pipeline's idle slots). Two ways to split it:

- ``torch.distributed.pipelining`` runs B as ``autograd.grad`` with respect to the stage input only, keeping the
  graph alive, then W as a second ``autograd.grad`` with respect to the parameters from the intermediate
  gradients it captured. The whole graph (every activation) stays alive until W, and W walks it again.
- The zero-bubble authors' fork (and Transformer Engine's ``delay_wgrad_compute``) defer only the weight GEMM
  of the linear layers: B is the ordinary backward, in which a linear layer returns its input gradient and
  keeps ``(input, output gradient)``; W computes ``grad_output^T @ input`` for each kept pair.

We take the second: it is exact (the same products as autograd's own linear backward, in the same order per
parameter), W costs exactly the weight GEMMs, and what stays alive between B and W is one input and one output
gradient per linear layer, not the graph. Every other parameter (norms, biases, embeddings, routers, experts,
adapters) gets its gradient in B, as usual: the linear weights are almost all of W's work in a transformer.

W hands each weight gradient to autograd as a backward from the weight itself (``torch.autograd.backward`` on
the leaf), so it accumulates into ``.grad`` and runs the parameter's post-accumulate hooks exactly as a normal
backward would: the fp32 ``main_grad`` buffers and the overlapped DP/ZeRO-1 reductions see no difference.
"""

from __future__ import annotations

import contextlib
from typing import Hashable, Iterator, Optional

import torch
import torch.nn.functional as F


class WeightGradStore:
    """Weight gradients deferred by the backward passes run under :meth:`capture`, computed by :meth:`apply`.

    Outside a capture (every backward of a schedule that does not split, forward-only runs) the layers that
    hold this store compute their weight gradients immediately, as without it.
    """

    def __init__(self) -> None:
        self._capturing: Optional[list] = None
        self._deferred: dict[Hashable, list] = {}

    @property
    def capturing(self) -> bool:
        return self._capturing is not None

    @contextlib.contextmanager
    def capture(self, key: Hashable) -> Iterator[None]:
        """Backwards run inside defer their linear layers' weight gradients under ``key`` (a microbatch of a chunk)."""
        if self._capturing is not None:
            raise RuntimeError("weight-gradient captures do not nest")
        if key in self._deferred:
            raise RuntimeError(f"the weight gradients of {key!r} were captured twice without being applied")
        self._capturing = []
        try:
            yield
            self._deferred[key] = self._capturing
        finally:
            self._capturing = None

    def defer(self, weight: torch.Tensor, inputs: torch.Tensor, grad_output: torch.Tensor) -> None:
        assert self._capturing is not None
        self._capturing.append((weight, inputs, grad_output))

    def clear(self) -> None:
        """Drop whatever a step that ended early (an exception between a B and its W) left captured."""
        self._deferred.clear()
        self._capturing = None

    @property
    def pending(self) -> int:
        """Captured backwards whose weight gradients are not applied yet."""
        return len(self._deferred)

    @torch.no_grad()
    def apply(self, key: Hashable) -> None:
        """Compute the weight gradients captured under ``key`` and accumulate them as a backward would."""
        captured = self._deferred.pop(key)
        grads: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
        # In the order the backward met the layers, as autograd would have accumulated them; a weight met twice
        # (a layer called twice in one forward) has its products summed first and accumulated once.
        for weight, inputs, grad_output in captured:
            grad = weight_grad(inputs, grad_output)
            if id(weight) in grads:
                grads[id(weight)] = (weight, grads[id(weight)][1] + grad)
            else:
                grads[id(weight)] = (weight, grad)
        captured.clear()
        if grads:
            weights, values = zip(*grads.values())
            with torch.enable_grad():
                torch.autograd.backward(list(weights), list(values))


def weight_grad(inputs: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """``grad_output^T @ inputs`` over every leading dimension: a linear layer's weight gradient."""
    return grad_output.reshape(-1, grad_output.shape[-1]).t().mm(inputs.reshape(-1, inputs.shape[-1]))


class _DeferrableLinear(torch.autograd.Function):
    """``F.linear`` whose backward leaves the weight gradient to ``store`` while the store captures.

    The weight enters detached, with no autograd edge of its own: a Function that returns no gradient for an
    input still runs that input's accumulation (and its post-accumulate hooks, with no gradient), which the
    gradient buffers would take for the parameter's gradient of this backward. The backward hands the
    gradient to the parameter itself, deferred (:meth:`WeightGradStore.apply`) or at once (the same call, nested).
    """

    @staticmethod
    def forward(ctx, inputs, weight, bias, store, parameter):
        ctx.save_for_backward(inputs, weight)
        ctx.store, ctx.parameter, ctx.has_bias = store, parameter[0], bias is not None
        return F.linear(inputs, weight, bias)

    @staticmethod
    def backward(ctx, grad_output):
        inputs, weight = ctx.saved_tensors
        grad_input = grad_output.matmul(weight) if ctx.needs_input_grad[0] else None
        if ctx.store.capturing:
            ctx.store.defer(ctx.parameter, inputs, grad_output)
        else:
            with torch.enable_grad():
                torch.autograd.backward([ctx.parameter], [weight_grad(inputs, grad_output)])
        grad_bias = None
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_output.reshape(-1, grad_output.shape[-1]).sum(0)
        return grad_input, None, grad_bias, None, None


def deferrable_linear(
    inputs: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], store: WeightGradStore
) -> torch.Tensor:
    """``F.linear(inputs, weight, bias)`` for a ``weight`` parameter that requires a gradient, whose gradient ``store``
    may defer (see the module docstring)."""
    return _DeferrableLinear.apply(inputs, weight.detach(), bias, store, (weight,))

"""The peer of ``benchmarks/moe.py``: megatron-core's ``MoELayer`` (0.16.1, local ``SequentialMLP`` experts) on CPU,
built like ours and given our router and expert weights, with the fewest in-process patches of its CUDA calls.

Only the benchmark imports this, in a forked process: the patches never touch a training run.
"""

from __future__ import annotations

import contextlib
import warnings
from unittest import mock

import torch


def megatron_version() -> str:
    try:
        from importlib.metadata import version

        return version("megatron-core")
    except Exception:
        return "(not installed)"


def megatron_on_cpu() -> contextlib.ExitStack:
    """The patches that run megatron-core 0.16.1's ``MoELayer`` on CPU, undone when the stack closes."""
    from megatron.core.transformer.moe import moe_utils, token_dispatcher

    alltoall = token_dispatcher.MoEAlltoAllTokenDispatcher
    stack = contextlib.ExitStack()
    # TopKRouter.gating moves a router weight it finds on the CPU to `torch.cuda.current_device()`, every call
    stack.enter_context(mock.patch("torch.cuda.current_device", lambda: torch.device("cpu")))
    # router_gating_linear tests `te_general_gemm`, which moe_utils binds only when Transformer Engine imports
    # (a NameError without it); None is its own switch to the plain torch GEMM. Not CUDA: a missing name.
    stack.enter_context(mock.patch.object(moe_utils, "te_general_gemm", None, create=True))
    # the alltoall dispatcher's __init__ creates a torch.cuda.Stream (once per class) for device-to-host copies...
    stack.enter_context(mock.patch.object(alltoall, "cuda_dtoh_stream", object()))
    # ... onto which it copies the split sizes and then waits on an event: on CPU they are host tensors already
    stack.enter_context(
        mock.patch.object(
            alltoall, "_maybe_dtoh_and_synchronize", lambda self, point, tokens_per_expert=None: tokens_per_expert
        )
    )
    return stack


def import_megatron():
    """megatron-core's ``parallel_state`` (initialise it over the live one-rank process group before building)."""
    with warnings.catch_warnings():  # "Transformer Engine and Apex are not installed": the local path is the point
        warnings.simplefilter("ignore")
        from megatron.core import parallel_state

    return parallel_state


def megatron_moe_layer(ours, args, dispatcher: str):
    """megatron-core's ``MoELayer`` of our layer's shape (SwiGLU, no biases, aux loss 1e-2), our layer's router and
    expert weights copied in; build it inside :func:`megatron_on_cpu`."""
    with warnings.catch_warnings():  # Apex's fused norm, CUDA-graph scopes: GPU options, not this comparison's
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
        from megatron.core.transformer.spec_utils import build_module
        from megatron.core.transformer.transformer_config import TransformerConfig

        config = TransformerConfig(
            num_layers=1,
            hidden_size=args.hidden_size,
            num_attention_heads=args.num_attention_heads,
            num_moe_experts=args.num_experts,
            moe_router_topk=args.topk,
            moe_ffn_hidden_size=args.moe_ffn_hidden_size,
            ffn_hidden_size=args.moe_ffn_hidden_size,
            gated_linear_unit=True,  # SwiGLU, fc1 = [gate; up] like ours
            activation_func=torch.nn.functional.silu,
            add_bias_linear=False,
            moe_token_dispatcher_type=dispatcher,
            moe_router_load_balancing_type="aux_loss",
            moe_aux_loss_coeff=1e-2,
            # our engine normalises the loss per token and so scales the aux loss's gradient by the layer's tokens:
            # Megatron's calculate_per_token_loss does the same
            calculate_per_token_loss=True,
            use_cpu_initialization=True,
        )
        spec = get_moe_module_spec(use_te=False, num_experts=args.num_experts)
        theirs = build_module(spec, config=config, layer_number=1).train()
    with torch.no_grad():
        theirs.router.weight.copy_(ours.router.weight)
        for i, expert in enumerate(theirs.experts.local_experts):
            expert.linear_fc1.weight.copy_(ours.experts.linear_fc1.weight[i])
            expert.linear_fc2.weight.copy_(ours.experts.linear_fc2.weight[i])
    return theirs


def compare(ours, theirs, x: torch.Tensor, grad: torch.Tensor) -> dict:
    """Max |difference| of the outputs and of every gradient, same input and output gradient."""
    results = []
    for layer in (ours, theirs):
        layer.zero_grad()
        inputs = x.clone().requires_grad_()
        out = layer(inputs)
        out = out[0] if isinstance(out, tuple) else out  # megatron-core's returns (output, bias)
        (out * grad).sum().backward()
        results.append((out.detach(), inputs.grad, layer.router.weight.grad))
    fc1 = torch.stack([e.linear_fc1.weight.grad for e in theirs.experts.local_experts])
    fc2 = torch.stack([e.linear_fc2.weight.grad for e in theirs.experts.local_experts])
    (out, x_grad, router), (ref_out, ref_x_grad, ref_router) = results

    def diff(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).abs().max())

    return dict(
        output=diff(out, ref_out),
        output_scale=float(ref_out.abs().max()),
        input_grad=diff(x_grad, ref_x_grad),
        router_grad=diff(router, ref_router),
        expert_grads=max(
            diff(ours.experts.linear_fc1.weight.grad, fc1), diff(ours.experts.linear_fc2.weight.grad, fc2)
        ),
    )

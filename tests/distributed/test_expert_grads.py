"""Expert parameters under MoE parallel folding (issue 23): their gradients are summed over the expert-data-parallel
group ('edp', not DP x CP), counted once per (pp, ep, etp) position in the global norm, and sharded by ZeRO-1 over
'edp' -- proven against a single-process reference on forked gloo ranks.

The model is built by hand so that the reference is computable without a token dispatcher: a dense MLP (column-
and row-parallel, sequence-parallel under SP) feeds an expert weight ``[E_local, H, OUT]`` (split over 'ep', its
columns over 'etp') and an expert gain ``[E_local, OUT]`` (replicated over 'etp'). Data-parallel rank d sends its
tokens through the experts of expert group ``d % ep``: those experts' gradients come from the EDP ranks of their
group only, so summing them over DP x CP (or counting the ETP-replicated gain twice in the norm) gives a different
update than the reference's.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from spawn_utils import run_ranks
from torch import nn

from megatron_lite import ParallelConfig, ParallelLayout
from megatron_lite.core.optim import OptimizerConfig
from megatron_lite.core.optim.distributed import DistributedOptimizer
from megatron_lite.core.optim.optimizer import MegatronOptimizer
from megatron_lite.core.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
)
from megatron_lite.core.parallel.tensor_parallel import (
    ColumnParallelLinear,
    ExpertShard,
    RowParallelLinear,
    TPShard,
    local_shard,
    mark_parameter,
)

E, H, FFN, OUT, S = 4, 8, 16, 6, 8  # experts, hidden, dense ffn, expert output, tokens per microbatch and rank
STEPS, MICRO = 2, 2
CLIP = 0.05
OPTIMIZERS = {  # (distributed optimizer, overlap_grad_reduce, bucket size in elements)
    "plain": (False, False, None),
    "plain_overlap": (False, True, 100),
    "zero1": (True, False, None),
    "zero1_overlap": (True, True, 100),
}


def full_weights() -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    shapes = {
        "up.weight": (FFN, H),
        "up.bias": (FFN,),
        "down.weight": (H, FFN),
        "down.bias": (H,),
        "experts": (E, H, OUT),
        "gain": (E, OUT),
    }
    return {name: torch.randn(shape, generator=gen) * 0.5 for name, shape in shapes.items()}


def data(dp: int) -> torch.Tensor:
    """[step, microbatch, data-parallel slice, token, hidden]."""
    return torch.randn(STEPS, MICRO, dp, S, H, generator=torch.Generator().manual_seed(1))


def expert_forward(h: torch.Tensor, experts: torch.Tensor, gain: torch.Tensor, etp_group=None) -> torch.Tensor:
    """Token i of ``h`` goes through local expert i % E_local; the loss is the squared expert outputs."""
    loss = h.new_zeros(())
    for j in range(experts.shape[0]):
        y = gather_from_tensor_parallel_region(h[j :: experts.shape[0]] @ experts[j], etp_group)
        loss = loss + (y * gain[j]).pow(2).sum()
    return loss


class TinyMoE(nn.Module):
    def __init__(self, layout: ParallelLayout):
        super().__init__()
        self.layout = layout
        self.up = ColumnParallelLinear(H, FFN, layout)
        self.down = RowParallelLinear(FFN, H, layout)
        etp, local = layout.etp_size, E // layout.ep_size
        experts = ExpertShard(E, layout.ep_rank, layout.ep_size)
        # the TP shard's global shape is this rank's experts' (the ExpertShard covers dimension 0)
        columns = TPShard(2, 1, (local, H, OUT), layout.etp_rank, etp, group="etp") if etp > 1 else None
        self.experts = mark_parameter(
            nn.Parameter(torch.empty(local, H, OUT // etp)), ("zeros",), columns, expert_shard=experts
        )
        self.gain = mark_parameter(nn.Parameter(torch.empty(local, OUT)), ("zeros",), None, expert_shard=experts)

    def forward(self, x: torch.Tensor, num_tokens: int) -> torch.Tensor:
        h = self.down(F.gelu(self.up(x)))
        etp_group = self.layout.group("etp")
        if self.layout.sequence_parallel:  # every ETP rank's experts see the whole sequence
            h = gather_from_sequence_parallel_region(h, etp_group, grad_is_partial=True)
        else:
            h = copy_to_tensor_parallel_region(h, etp_group)
        return expert_forward(h, self.experts, self.gain, etp_group) / num_tokens


def reference(ep: int, dp: int) -> dict:
    """One process, whole tensors: data slice d through the experts of group d % ep, clipped SGD with momentum."""
    weights = {n: w.clone().requires_grad_() for n, w in full_weights().items()}
    opt = torch.optim.SGD(weights.values(), lr=1.0, momentum=0.9)
    x, num_tokens, local = data(dp), MICRO * dp * S, E // ep
    norms, grads = [], []
    for step in range(STEPS):
        opt.zero_grad()
        loss = torch.zeros(())
        for micro in range(MICRO):
            for d in range(dp):
                w = weights
                h = F.linear(F.gelu(F.linear(x[step, micro, d], w["up.weight"], w["up.bias"])), w["down.weight"])
                group = slice((d % ep) * local, (d % ep + 1) * local)
                loss = loss + expert_forward(h + w["down.bias"], w["experts"][group], w["gain"][group]) / num_tokens
        loss.backward()
        norm = torch.sqrt(sum(w.grad.pow(2).sum() for w in weights.values()))
        for w in weights.values():
            w.grad.mul_((CLIP / (norm + 1e-6)).clamp(max=1.0))
        norms.append(norm)
        grads.append({n: w.grad.clone() for n, w in weights.items()})
        opt.step()
    momentum = {n: opt.state[w]["momentum_buffer"] for n, w in weights.items()}
    return {
        "norms": norms,
        "grads": grads,
        "weights": {n: w.detach() for n, w in weights.items()},
        "momentum": momentum,
    }


def _train(rank, world_size, parallel: dict, optimizers: list):
    layout = ParallelLayout.build(ParallelConfig(**parallel))
    assert layout.ep_rank == layout.dp_rank % layout.ep_size  # the routing reference() assumes
    ref = reference(layout.ep_size, layout.dp_size)
    assert min(ref["norms"]) > CLIP, "clipping must be active for the norm to matter"
    out = {name: [f"{name} rank {rank}: {m}" for m in _mismatches(layout, name, ref)] for name in optimizers}
    dist.barrier()
    layout.destroy()
    return out


def _mismatches(layout: ParallelLayout, name: str, ref: dict) -> list[str]:
    """Train TinyMoE with optimizer ``name``; what differs from the reference ``ref``."""
    distributed, overlap, bucket_size = OPTIMIZERS[name]
    model = TinyMoE(layout)
    params = dict(model.named_parameters())
    with torch.no_grad():
        for n, full in full_weights().items():
            params[n].copy_(local_shard(params[n], full))
    config = OptimizerConfig(optimizer="sgd", lr=1.0, sgd_momentum=0.9, weight_decay=0.0, clip_grad=CLIP)
    kind = DistributedOptimizer if distributed else MegatronOptimizer
    opt = kind(model, config, layout, bucket_size=bucket_size, overlap_grad_reduce=overlap)
    assert [b.group.name for b in opt.grad_buffers.buckets][-1] == "edp", "experts in buckets of their own, last"
    x, num_tokens = data(layout.dp_size), MICRO * layout.dp_size * S
    mismatches: list[str] = []

    def check(what, got, want):
        if not torch.allclose(got, want, rtol=1e-5, atol=1e-6):
            mismatches.append(f"{what} differs by {(got - want).abs().max().item():.3g}")

    for step in range(STEPS):
        opt.zero_grad()
        for micro in range(MICRO):
            tokens = x[step, micro, layout.dp_rank]
            if layout.sequence_parallel:
                tokens = tokens.chunk(layout.tp_size)[layout.tp_rank]
            if micro < MICRO - 1:
                with opt.no_sync():
                    model(tokens, num_tokens).backward()
            else:
                model(tokens, num_tokens).backward()
        result = opt.prepare_step()
        check(f"step {step} grad norm", result.grad_norm, ref["norms"][step])
        # The reduced, clipped gradients this rank steps with: whole local tensors, or ZeRO-1's slices of them.
        if distributed:
            for piece in (piece for shard in opt.shards for piece in shard.pieces):
                want = local_shard(piece.param, ref["grads"][step][piece.name]).reshape(-1)
                check(f"step {step} {piece.name} grad", piece.main.grad, want[piece.param_lo : piece.param_hi])
        else:
            for n, p in params.items():
                check(f"step {step} {n} grad", p.grad, local_shard(p, ref["grads"][step][n]))
        opt.optimizer.step()
        opt.finish_step(result)
    for n, p in params.items():
        check(f"{n} after {STEPS} steps", p.detach(), local_shard(p, ref["weights"][n]))
    state = opt.checkpoint_state()  # ZeRO-1 gathers each parameter's state over its group
    for n, entry in state.items():
        check(f"{n} momentum", entry["momentum_buffer"], local_shard(params[n], ref["momentum"][n]))
    if overlap:
        assert opt.overlapped_reductions == STEPS * len(opt.grad_buffers.buckets), name
    opt.remove_hooks()
    if distributed:  # and back: a fresh ZeRO-1 optimizer takes its own slices of the gathered state
        fresh = DistributedOptimizer(model, config, layout, bucket_size=bucket_size)
        fresh.ensure_state()
        fresh.load_checkpoint_state(state)
        for n, entry in fresh.checkpoint_state().items():
            check(f"{n} momentum reloaded", entry["momentum_buffer"], local_shard(params[n], ref["momentum"][n]))
        fresh.remove_hooks()
    return mismatches


LAYOUTS = {
    # TP1: dp 4; experts split over EP 2, each one replicated over EDP 2 (ranks 0,2 and 1,3), dense over DP 4
    "ep2": dict(expert_model_parallel_size=2),
    # TP2 x DP2, SP on: ETP2 x EP2 x EDP1 -- each expert shard lives on one rank, dense weights on two
    "tp2_ep2_sp": dict(tensor_model_parallel_size=2, sequence_parallel=True, expert_model_parallel_size=2),
}


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_expert_gradients_norm_and_zero1_match_single_process(name):
    """Plain and distributed optimizer, with and without overlapped reduction: every step's global norm, the
    reduced clipped gradients, the weights after two clipped SGD-momentum steps and the gathered momentum equal the
    single-process reference."""
    results = run_ranks(_train, 4, LAYOUTS[name], list(OPTIMIZERS))
    mismatches = [m for result in results for ms in result.values() for m in ms]
    assert not mismatches, "\n".join(mismatches[:20])

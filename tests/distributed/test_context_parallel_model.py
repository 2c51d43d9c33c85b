"""A GPTModel under context parallelism (core, no Lightning) computes the single-process model's loss
and gradients: each CP rank runs its zigzag share of the rows, the loss sums and the gradients are
summed over CP; with TP and sequence parallelism too, with packed rows, with recompute, with qk_layernorm, with
multi-latent attention, with multi-token prediction (its shifts cross the CP chunks and packed documents; its loss
summed over CP equals the reported one); full_logits
and generation run the whole rows on every CP rank."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from mla_utils import TINY_MLA, TINY_YARN
from spawn_utils import run_ranks

import megatron_lite as ml
from megatron_lite.core.parallel.context_parallel import context_parallel_microbatch
from megatron_lite.core.parallel.data_parallel import partial_grad_group
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.schedules import gpt_loss
from megatron_lite.core.parallel.tensor_parallel import gather_full

# Multi-latent attention with values narrower than its queries/keys and YaRN's softmax scale; attention far enough
# from uniform that a wrong scale shows
MLA = dict(TINY_MLA, **TINY_YARN, q_lora_rank=12, init_method_std=0.05)
FULL_RECOMPUTE = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)


def _config(**overrides) -> ml.GPTConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=128,
        seq_length=32,
        make_vocab_size_divisible_by=32,
    )
    base.update(overrides)
    return ml.GPTConfig(**base)


def _microbatch(packed: bool) -> dict:
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(3))
    mb = {"tokens": tokens, "loss_mask": torch.ones(2, 32)}
    if packed:
        mb["cu_seqlens"] = torch.tensor([[0, 7, 19, 33], [0, 16, 25, -1]], dtype=torch.int32)
        mb["position_ids"] = torch.stack(
            [
                torch.cat([torch.arange(7), torch.arange(12), torch.arange(13)]),
                torch.cat([torch.arange(16), torch.arange(9), torch.arange(7)]),
            ]
        )
        mb["loss_mask"][0, [6, 18]] = 0
        mb["loss_mask"][1, [15, 24]] = 0
    return mb


def _loss_and_grads(model, mb):
    loss, count = gpt_loss(model, mb)
    loss.backward()
    return loss.detach(), count


def _rank(rank, world_size, tp, sp, packed, overrides, comm_type):
    layout = ParallelLayout.build(
        ParallelConfig(
            tensor_model_parallel_size=tp,
            sequence_parallel=sp,
            context_parallel_size=world_size // tp,
            cp_comm_type=comm_type,
        )
    )
    model = ml.GPTModel(_config(**overrides), layout, seed=5)
    model.train()
    mb = _microbatch(packed)
    loss, count = _loss_and_grads(model, context_parallel_microbatch(mb, layout.cp_size, layout.cp_rank))
    report = model.take_step_report().get("mtp_loss", torch.zeros(2))  # [sum, count] of the MTP loss
    totals = torch.cat([torch.stack([loss, torch.as_tensor(count, dtype=loss.dtype)]), report.to(loss.dtype)])
    dist.all_reduce(totals, group=layout.group("cp"))
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad.clone()
        dist.all_reduce(g, group=layout.group("cp"))
        if partial_grad_group(p, sp) == "tp":
            dist.all_reduce(g, group=layout.group("tp"))
        grads[name] = gather_full(g, getattr(p, "tp_shard", None), layout.group("tp"))
    logits = model.full_logits(mb["tokens"][:, :-1])
    return totals, grads, logits


@pytest.mark.parametrize(
    "world,tp,sp,packed,overrides,comm_type",
    [
        (2, 1, False, False, {}, "p2p"),
        (2, 1, False, True, {"qk_layernorm": True, "mtp_num_layers": 2, "mtp_loss_scaling_factor": 0.5}, "all_gather"),
        (4, 1, False, True, {}, "p2p"),
        (4, 2, True, False, {"recompute_granularity": "selective", "qk_layernorm": True}, "p2p"),
        (
            2,
            1,
            False,
            False,
            {"position_embedding_type": "learned_absolute", "normalization": "LayerNorm", "activation": "gelu"},
            "p2p",
        ),
        (4, 2, True, True, dict(MLA, mtp_num_layers=1, **FULL_RECOMPUTE), "p2p"),
    ],
    ids=[
        "cp2",
        "cp2-packed-allgather-qknorm-mtp",
        "cp4-packed",
        "tp2-cp2-sp-recompute-qknorm",
        "cp2-learned-pos",
        "tp2-cp2-sp-packed-mla-mtp-recompute",
    ],
)
def test_context_parallel_model_equals_single_process(world, tp, sp, packed, overrides, comm_type):
    torch.set_num_threads(1)
    reference = ml.GPTModel(_config(**overrides), seed=5)
    reference.train()
    mb = _microbatch(packed)
    ref_loss, ref_count = _loss_and_grads(reference, mb)
    ref_report = reference.take_step_report().get("mtp_loss", torch.zeros(2))
    assert (ref_report[0] > 0) == ("mtp_num_layers" in overrides)
    ref_grads = {name: p.grad for name, p in reference.named_parameters()}
    ref_logits = reference.full_logits(mb["tokens"][:, :-1])
    for totals, grads, logits in run_ranks(_rank, world, tp, sp, packed, overrides, comm_type):
        assert float(totals[1]) == float(ref_count)
        torch.testing.assert_close(totals[0], ref_loss, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(totals[2:], ref_report.to(totals.dtype), rtol=1e-5, atol=1e-5)
        assert grads.keys() == ref_grads.keys()
        for name, grad in grads.items():
            torch.testing.assert_close(grad, ref_grads[name], rtol=1e-5, atol=1e-6, msg=f"gradient of {name}")
        torch.testing.assert_close(logits, ref_logits, rtol=1e-5, atol=1e-5)


def _refuse_dropout(rank, world_size):
    layout = ParallelLayout.build(ParallelConfig(context_parallel_size=2))
    with pytest.raises(ValueError, match="attention_dropout=0.0 or context_parallel_size=1"):
        ml.GPTModel(_config(attention_dropout=0.1), layout)
    model = ml.GPTModel(_config(), layout)
    with pytest.raises(ValueError, match="context_parallel_microbatch"):
        model(torch.zeros(1, 16, dtype=torch.long), torch.zeros(1, 16, dtype=torch.long))
    return True


def test_context_parallel_refusals():
    assert all(run_ranks(_refuse_dropout, 2))

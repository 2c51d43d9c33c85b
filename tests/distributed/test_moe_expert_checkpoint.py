"""Expert weights are checkpointed as their tensors of all experts, so EP, ETP and TP can change on resume.

Four forked gloo ranks hold two MoE layers' experts (SwiGLU with biases, GeLU without), set from known global
tensors, and go through the resharding matrix with the real DCP save and load of core/checkpoint:
EP2 x ETP2 (TP2) -> EP4 -> EP1, and EP2 x ETP2 -> TP2 (ETP = TP, no expert mesh) -> ETP1 with TP2. After every
load each rank's experts are exactly its piece of the global tensors; the full-state gather at EP2 x ETP2 gives
the global tensors; and one process (EP1) reads the EP2 and EP4 checkpoints, as ``load_sharded`` and as
``from_pretrained`` does."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from spawn_utils import run_ranks
from torch import nn

from megatron_lite.core.checkpoint.format.sharded import load_sharded, save_sharded
from megatron_lite.core.checkpoint.full.state import gather_full_state
from megatron_lite.core.checkpoint.state import sharded_model_state
from megatron_lite.core.models.config import GPTConfig
from megatron_lite.core.models.moe.experts import GroupedExperts
from megatron_lite.core.parallel.layout import ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.tensor_parallel import full_shape, local_shard
from megatron_lite.pretrained import _load_checkpoint_weights

EXPERTS = 4
CONFIGS = {
    "swiglu": dict(activation="swiglu", add_bias_linear=True),
    "gelu": dict(activation="gelu", add_bias_linear=False),
}
EP2_ETP2 = dict(tensor_model_parallel_size=2, expert_model_parallel_size=2)
EP4 = dict(expert_model_parallel_size=4)
EP1 = dict()
TP2 = dict(tensor_model_parallel_size=2)  # ETP = TP and EP 1: the experts use the dense mesh's TP dimension
ETP1_TP2 = dict(tensor_model_parallel_size=2, expert_tensor_parallel_size=1)


def _config(kind: str) -> GPTConfig:
    return GPTConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        ffn_hidden_size=32,
        num_moe_experts=EXPERTS,
        moe_ffn_hidden_size=8,
        **CONFIGS[kind],
    )


def _holder(layout: ParallelLayout) -> nn.Module:
    """Two MoE layers' experts where a GPTModule keeps its model (``model.<name>``), the names checkpoints use."""
    holder = nn.Module()
    holder.model = nn.ModuleDict(
        {kind: GroupedExperts(_config(kind), layout, output_init_std=0.01) for kind in CONFIGS}
    )
    return holder


def _global_tensors(holder: nn.Module) -> dict[str, torch.Tensor]:
    """The global tensor of every expert weight, known to every rank (drawn from its name)."""
    return {
        name: torch.randn(full_shape(p), generator=torch.Generator().manual_seed(len(name) * 7 + i))
        for i, (name, p) in enumerate(holder.model.named_parameters())
    }


def _mismatches(holder: nn.Module, expected: dict[str, torch.Tensor]) -> list[str]:
    """The weights that are not exactly this rank's piece of the global tensors."""
    return [n for n, p in holder.model.named_parameters() if not torch.equal(p, local_shard(p, expected[n]))]


def _on_ranks(rank: int, world_size: int, directory: str):
    directory = Path(directory)
    results: dict[str, object] = {}

    def on_layout(name: str, parallel: dict, load: str | None = None, save: bool = False) -> None:
        layout = ParallelLayout.build(ParallelConfig(**parallel))
        try:
            holder = _holder(layout)
            expected = _global_tensors(holder)
            if load is None:
                with torch.no_grad():
                    for n, p in holder.model.named_parameters():
                        p.copy_(local_shard(p, expected[n]))
            else:
                with torch.no_grad():
                    for p in holder.parameters():
                        p.fill_(float("nan"))  # nothing the load does not write can pass
                load_sharded({"model": sharded_model_state(holder, layout)}, directory / load)
                results[f"{load}->{name}"] = _mismatches(holder, expected)
            if save:
                save_sharded({"model": sharded_model_state(holder, layout)}, directory / name)
            if name == "ep2_etp2":
                results["full_state"] = gather_full_state(holder.model, layout)
            results[f"{name}_local_shapes"] = {n: tuple(p.shape) for n, p in holder.model.named_parameters()}
        finally:
            layout.destroy()

    on_layout("ep2_etp2", EP2_ETP2, save=True)
    on_layout("ep4", EP4, load="ep2_etp2", save=True)
    on_layout("ep1", EP1, load="ep4")
    on_layout("tp2", TP2, load="ep2_etp2", save=True)
    on_layout("etp1_tp2", ETP1_TP2, load="tp2")
    return results


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")  # the one-process load, as intended
def test_expert_checkpoints_reshard_over_ep_etp_and_tp(tmp_path: Path):
    results = run_ranks(_on_ranks, 4, str(tmp_path))
    one_process = _holder(ParallelLayout.single())
    expected = _global_tensors(one_process)
    # the layouts really split the experts as intended (EP2 x ETP2 halves both ways, EP4 one expert per rank)
    assert results[3]["ep2_etp2_local_shapes"]["swiglu.linear_fc1.weight"] == (2, 8, 16)
    assert results[3]["ep4_local_shapes"]["swiglu.linear_fc2.weight"] == (1, 16, 8)
    assert results[3]["tp2_local_shapes"]["gelu.linear_fc2.weight"] == (4, 16, 4)
    assert results[3]["etp1_tp2_local_shapes"]["swiglu.linear_fc1.weight"] == (4, 16, 16)
    for rank, result in enumerate(results):
        for step in ("ep2_etp2->ep4", "ep4->ep1", "ep2_etp2->tp2", "tp2->etp1_tp2"):
            assert result[step] == [], f"rank {rank}, {step}: {result[step]} differ from the saved experts"
    full = results[0]["full_state"]
    assert full.keys() == expected.keys()
    for name, tensor in expected.items():
        assert torch.equal(full[name], tensor), name
    assert all(result["full_state"] is None for result in results[1:])
    # one process (EP1, ETP1) reads the EP2 x ETP2 and the EP4 checkpoints
    for saved in ("ep2_etp2", "ep4"):
        with torch.no_grad():
            for p in one_process.parameters():
                p.fill_(float("nan"))
        load_sharded({"model": sharded_model_state(one_process, ParallelLayout.single())}, tmp_path / saved)
        assert _mismatches(one_process, expected) == [], saved
        fresh = _holder(ParallelLayout.single())
        _load_checkpoint_weights(fresh.model, tmp_path / saved, 1024, strict=True, config=_config("swiglu"))
        assert _mismatches(fresh, expected) == [], saved

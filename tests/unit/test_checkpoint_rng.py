"""RNG states in checkpoints: when they may be restored, and what replaces them when not.

The layouts here are described, not built (no process group): the fingerprint reads only sizes and
coordinates. The Trainer-level branches (restored bit for bit at the same layout; re-derived with one note
from rank 0 after TP2 -> DP2) are in tests/distributed/test_exact_resume.py.
"""

from __future__ import annotations

import torch

import megatron_lite as ml
from megatron_lite.core.checkpoint.resume.rng import (
    FINGERPRINT_FIELDS,
    derived_cpu_generator_state,
    derived_seed,
    layout_fingerprint,
    layout_mismatch,
    rederive_rng_state,
    restore_rng_state,
    rng_state,
)
from megatron_lite.core.parallel.layout import MESH_DIMS, ParallelConfig, ParallelLayout
from megatron_lite.core.parallel.random import DATA_PARALLEL_RNG, MODEL_PARALLEL_RNG


def described(world_size: int, rank: int, **sizes) -> ParallelLayout:
    """Rank ``rank``'s layout, with coordinates in Megatron's order (tp fastest, then cp, ep, dp, pp)."""
    config = ParallelConfig(**sizes)
    shape = {
        "tp": config.tensor_model_parallel_size,
        "cp": config.context_parallel_size,
        "ep": config.expert_model_parallel_size,
        "dp": config.data_parallel_size(world_size),
        "pp": config.pipeline_model_parallel_size,
    }
    coords, rest = {}, rank
    for dim in reversed(MESH_DIMS):  # tp, cp, ep, dp, pp
        coords[dim], rest = rest % shape[dim], rest // shape[dim]
    return ParallelLayout(config=config, world_size=world_size, rank=rank, coords=coords)


def saved_at(layout: ParallelLayout) -> dict[str, torch.Tensor]:
    return {
        f"rng_rank{layout.rank}.torch": torch.get_rng_state(),
        f"rng_rank{layout.rank}.layout": layout_fingerprint(layout),
    }


def test_the_same_layout_and_rank_may_restore():
    layout = described(8, 5, tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    assert (
        layout_mismatch(
            saved_at(layout), described(8, 5, tensor_model_parallel_size=2, pipeline_model_parallel_size=2), 5
        )
        is None
    )


def test_a_tp_change_at_the_same_world_size_is_named():
    # rank 1 at TP2 is TP rank 1 of the only replica; at DP2 it is the second replica: other streams
    reason = layout_mismatch(saved_at(described(2, 1, tensor_model_parallel_size=2)), described(2, 1), 1)
    assert reason is not None
    for change in ("tp 2 -> 1", "dp 1 -> 2", "tp_rank 1 -> 0", "dp_rank 0 -> 1"):
        assert change in reason, reason
    assert "world_size" not in reason


def test_every_dimension_counts():
    base = dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2)
    changed = [
        dict(base, virtual_pipeline_model_parallel_size=2),
        dict(base, sequence_parallel=True),
        dict(tensor_model_parallel_size=2, pipeline_model_parallel_size=2, context_parallel_size=2),
        dict(base, expert_model_parallel_size=2),
    ]
    for sizes, field in zip(changed, ("vpp", "sequence_parallel", "cp", "ep")):
        world = 16 if field in ("cp", "ep") else 8
        reason = layout_mismatch(saved_at(described(8, 0, **base)), described(world, 0, **sizes), 0)
        assert reason is not None and f"{field} " in reason, (field, reason)
    assert len(layout_fingerprint(described(8, 0, **base))) == len(FINGERPRINT_FIELDS)


def test_missing_states_or_layout_are_reasons_too():
    assert "fewer ranks" in layout_mismatch({}, described(4, 3), 3)
    assert "does not record" in layout_mismatch({"rng_rank0.torch": torch.get_rng_state()}, described(2, 0), 0)


def test_states_restore_exactly_and_rederive_from_the_seeds_per_step():
    config = ml.GPTConfig(
        num_layers=1,
        hidden_size=16,
        num_attention_heads=2,
        vocab_size=32,
        seq_length=8,
        hidden_dropout=0.5,
        attention_dropout=0.5,
    )
    model = ml.GPTModel(config, seed=11)
    model.train()
    model(torch.randint(0, 32, (1, 8)))  # creates and advances the dropout streams
    saved = rng_state(model, 0, ParallelLayout.single())
    assert torch.equal(saved["rng_rank0.layout"], layout_fingerprint(ParallelLayout.single()))
    streams = {k for k in saved if "|" in k}
    assert streams == {f"rng_rank0.root|{MODEL_PARALLEL_RNG}@cpu", f"rng_rank0.root|{DATA_PARALLEL_RNG}@cpu"}

    rederive_rng_state(model, step=7, cpu_generator=False)
    tracker = model.rng_tracker
    for name, seed in tracker.seeds.items():  # seed + 2718 + tp_rank, seed + 100 * pp_rank
        expected = torch.Generator().manual_seed(derived_seed(seed, 7)).get_state()
        assert torch.equal(tracker.states[(name, "cpu")], expected), name
        assert not torch.equal(tracker.states[(name, "cpu")], saved[f"rng_rank0.root|{name}@cpu"]), name
    other_step = torch.Generator().manual_seed(derived_seed(tracker.seeds[MODEL_PARALLEL_RNG], 8)).get_state()
    assert not torch.equal(tracker.states[(MODEL_PARALLEL_RNG, "cpu")], other_step)

    torch.manual_seed(5)
    assert torch.equal(derived_cpu_generator_state(7), torch.Generator().manual_seed(derived_seed(5, 7)).get_state())

    restore_rng_state(model, saved, 0)
    assert torch.equal(torch.get_rng_state(), saved["rng_rank0.torch"])
    for key in streams:
        name = key.split("|", 1)[1].split("@")[0]
        assert torch.equal(tracker.states[(name, "cpu")], saved[key])

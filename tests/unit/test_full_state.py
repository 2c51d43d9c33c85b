"""Full-state hand-over: the safetensors format (by its spec), and full tensors cut into any layout's shards.

The TP2 shards of both ranks are built side by side in this process (a layout with its coordinates and
no process group: construction and loading are local), so the test can put them back together."""

from __future__ import annotations

import json
import struct

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.checkpoint.format.safetensors_io import load_safetensors, save_safetensors
from megatron_lite.core.checkpoint.full.state import (
    carry_over_state,
    gather_full_state,
    load_full_state,
    read_full_state,
    write_full_state,
)
from megatron_lite.core.parallel.layout import MESH_DIMS, ParallelConfig, ParallelLayout


def _tp_layout(rank: int, tp: int = 2) -> ParallelLayout:
    return ParallelLayout(
        config=ParallelConfig(tensor_model_parallel_size=tp),
        world_size=tp,
        rank=rank,
        coords={d: (rank if d == "tp" else 0) for d in MESH_DIMS},
        groups={d: None for d in (*MESH_DIMS, "mp", "dp_cp")},
    )


def _config(**overrides) -> ml.GPTConfig:
    base = dict(
        num_layers=2,
        hidden_size=32,
        num_attention_heads=4,
        num_query_groups=2,
        vocab_size=100,
        seq_length=16,
        make_vocab_size_divisible_by=64,
        normalization="LayerNorm",
        ffn_hidden_size=64,
        activation="swiglu",
        add_bias_linear=True,
    )  # fused gate/up: stride 2
    base.update(overrides)
    return ml.GPTConfig(**base)


def _reassemble(shards: list[torch.nn.Module], unpad: bool = True) -> dict[str, torch.Tensor]:
    """The full tensors behind TP shards, by concatenating each block of each rank's piece (without the
    vocabulary padding unless ``unpad=False``)."""
    out = {}
    for name, p0 in shards[0].named_parameters():
        pieces = [dict(m.named_parameters())[name].detach() for m in shards]
        shard = p0.tp_shard
        if shard is None or shard.size == 1:
            out[name] = shard.unpad(pieces[0]) if shard is not None and unpad else pieces[0]
            continue
        blocks = [p.chunk(shard.stride, dim=shard.dim) for p in pieces]
        full = torch.cat([torch.cat([b[i] for b in blocks], dim=shard.dim) for i in range(shard.stride)], dim=shard.dim)
        out[name] = shard.unpad(full) if unpad else full
    return out


def test_safetensors_layout_follows_the_spec(tmp_path):
    tensors = {
        "w": torch.arange(6, dtype=torch.float32).reshape(2, 3),
        "flag": torch.tensor([True, False, True]),
        "h": torch.ones(3, dtype=torch.bfloat16),
        "empty": torch.zeros(0, 4),
    }
    path = tmp_path / "x.safetensors"
    save_safetensors(tensors, path, {"format": "test"})
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    assert n % 8 == 0 and header["__metadata__"] == {"format": "test"}
    assert header["w"] == {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}
    data = raw[8 + n :]
    spans = sorted(tuple(v["data_offsets"]) for k, v in header.items() if k != "__metadata__")
    assert spans[0][0] == 0 and spans[-1][1] == len(data)  # contiguous, no holes
    assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert torch.frombuffer(bytearray(data[:24]), dtype=torch.float32).tolist() == list(range(6))
    loaded, meta = load_safetensors(path)
    assert meta == {"format": "test"} and loaded.keys() == tensors.keys()
    for k, v in tensors.items():
        assert loaded[k].dtype == v.dtype and torch.equal(loaded[k], v)


def test_truncated_safetensors_is_refused(tmp_path):
    path = tmp_path / "x.safetensors"
    save_safetensors({"w": torch.ones(16)}, path)
    path.write_bytes(path.read_bytes()[:-8])
    with pytest.raises(
        ValueError,
        match=r"not a valid safetensors file: the tensors. data take 64 bytes but the file "
        r"holds 56 after its header \(truncated",
    ):
        load_safetensors(path)


def test_full_state_loads_into_tp_shards_and_back():
    config = _config()
    whole = ml.GPTModel(config, ParallelLayout.single(), seed=7)
    state = gather_full_state(whole, ParallelLayout.single())
    shards = [ml.GPTModel(config, _tp_layout(r), seed=99) for r in range(2)]  # other weights first
    for shard in shards:
        load_full_state(shard, state, vocab_size=config.vocab_size)
    for name, full in _reassemble(shards).items():
        torch.testing.assert_close(full, state[name], rtol=0, atol=0, msg=name)


def test_full_state_holds_the_real_vocabulary_whatever_the_padding(tmp_path):
    # vocab 100 padded to 128 at TP1 and to 256 at TP2 (make_vocab_size_divisible_by=128)
    config = _config(make_vocab_size_divisible_by=128)
    whole = ml.GPTModel(config, ParallelLayout.single(), seed=7)
    write_full_state(gather_full_state(whole, ParallelLayout.single()), tmp_path, rank=0)
    state = read_full_state(tmp_path)
    assert state["embedding.weight"].shape == (100, 32) and state["output_layer.weight"].shape == (100, 32)
    shards = [ml.GPTModel(config, _tp_layout(r), seed=99) for r in range(2)]
    for shard in shards:
        load_full_state(shard, state, vocab_size=config.vocab_size)
    for name in ("embedding.weight", "output_layer.weight"):
        after = _reassemble(shards, unpad=False)[name]
        assert after.shape == (256, 32)
        torch.testing.assert_close(after[:100], state[name], rtol=0, atol=0)
        assert not after[100:].any()  # the padding rows are zero
    # and back to one process: the real rows again
    back = ml.GPTModel(config, ParallelLayout.single(), seed=5)
    load_full_state(back, _reassemble(shards), vocab_size=config.vocab_size)
    torch.testing.assert_close(back.embedding.weight[:100], whole.embedding.weight[:100], rtol=0, atol=0)
    assert not back.embedding.weight[100:].any()


def test_a_full_state_with_padded_rows_loads_its_real_rows():
    """A tensor padded by someone else (an older full state, an exporter that pads) gives its first
    vocab_size rows; the model's padding stays zero."""
    config = _config(make_vocab_size_divisible_by=128)
    whole = ml.GPTModel(config, ParallelLayout.single(), seed=7)
    state = {k: v.clone() for k, v in gather_full_state(whole, ParallelLayout.single()).items()}
    state["embedding.weight"] = torch.cat([state["embedding.weight"], torch.ones(28, 32)])  # 128 rows
    back = ml.GPTModel(config, _tp_layout(1), seed=5)  # TP2 rank 1: real rows 100..127 of 256 are none
    load_full_state(back, state)
    assert back.embedding.weight.shape == (128, 32) and not back.embedding.weight.any()
    front = ml.GPTModel(config, _tp_layout(0), seed=5)
    load_full_state(front, state)
    torch.testing.assert_close(front.embedding.weight[:100], whole.embedding.weight[:100], rtol=0, atol=0)
    assert not front.embedding.weight[100:].any()


def test_other_shapes_are_refused():
    state = gather_full_state(ml.GPTModel(_config(), ParallelLayout.single()), ParallelLayout.single())
    with pytest.raises(ValueError, match="another configuration"):
        load_full_state(ml.GPTModel(_config(hidden_size=64), ParallelLayout.single()), state, vocab_size=100)
    with pytest.raises(ValueError, match="missing"):
        load_full_state(ml.GPTModel(_config(num_layers=3), ParallelLayout.single()), state, vocab_size=100)


def test_carry_over_cuts_shards_from_a_whole_model_and_keeps_equal_shards():
    config = _config()
    whole = ml.GPTModel(config, ParallelLayout.single(), seed=7)
    shards = [ml.GPTModel(config, _tp_layout(r), seed=99) for r in range(2)]
    for shard in shards:
        carry_over_state(whole, shard, vocab_size=config.vocab_size)
    reference = dict(whole.named_parameters())  # padded alike at TP1 and TP2 (128 rows)
    for name, full in _reassemble(shards, unpad=False).items():
        torch.testing.assert_close(full, reference[name].detach(), rtol=0, atol=0, msg=name)
    again = ml.GPTModel(config, _tp_layout(1), seed=3)  # the same shard under a new layout object
    carry_over_state(shards[1], again, vocab_size=config.vocab_size)
    for (name, a), b in zip(again.named_parameters(), shards[1].parameters()):
        assert torch.equal(a, b), name
    with pytest.raises(ValueError, match=r"tensor-parallel size 2 \(rank 0\) to 2 \(rank 1\)"):
        carry_over_state(shards[0], ml.GPTModel(config, _tp_layout(1), seed=3), vocab_size=100)

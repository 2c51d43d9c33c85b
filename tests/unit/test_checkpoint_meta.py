"""A checkpoint's metadata: meta.json (tagged JSON) round-trips what Lightning's checkpoint holds, refuses
anything else when written (naming the key and the fix), and reading one never imports or calls what it
names. Old checkpoints' meta.pt is read with weights_only=True: a crafted file runs no code."""

import dataclasses
import json
import math
import pathlib
import re
import sys

import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.checkpoint.errors import CheckpointMetaError
from megatron_lite.core.checkpoint.format import meta_json
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta


class Payload:
    """What an attacker would put in a downloaded checkpoint: code that runs when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


@dataclasses.dataclass
class DataConfig:
    """A user's own config class (allowed only when passed, as the strategy passes the live module's)."""

    path: str = "corpus"
    """Where the data is."""
    weights: tuple = (0.5, 0.5)
    """Blend weights."""


def _meta():
    """What Lightning's checkpoint dict holds besides tensors, with every type the encoding covers."""
    return {
        "epoch": 0,
        "global_step": 6,
        "pytorch-lightning_version": "2.6.6",
        "loops": {"fit_loop": {"state_dict": {"combined_loader": [{}]}, "epoch_progress": {"total": {"ready": 1}}}},
        "callbacks": {
            "ModelCheckpoint{'monitor': None}": {
                "best_model_score": None,
                "kth_value": torch.tensor(float("inf")),
                "dirpath": "/runs/ckpts",
                "best_k_models": {"/runs/ckpts/a.ckpt": torch.tensor(6.9512)},
            }
        },
        "lr_schedulers": [{"num_steps": 6, "unit": "iters"}],
        "hyper_parameters": {
            "config": ml.GPTConfig(num_layers=2, hidden_size=64, num_attention_heads=4),
            "optimizer": ml.OptimizerConfig(lr=3e-4, scale_lr_params=("bias",)),
            "seed": 7,
            "data": DataConfig(),
        },
        "optimizer_param_groups": [[{"betas": (0.9, 0.999), "lr": 1e-3, "eps": 1e-8, "fused": None}]],
        "megatron_lite_layout": {"tensor_model_parallel_size": 2, "world_size": 4},
        "numbers": [math.inf, -math.inf, 1e-300, 2**70, -0.0, True],
        "tensors": [
            torch.tensor([1.5, -2.25, float("nan")], dtype=torch.bfloat16),
            torch.arange(6, dtype=torch.int64).reshape(2, 3),
            torch.tensor([True, False]),
        ],
        "dtype": torch.bfloat16,
        "path": pathlib.Path("/data/corpus"),
        "int_keys": {0: "a", (1, 2): "b"},
        "looks_like_a_tag": {"__tuple__": [1]},
    }


def _same(a, b):
    if torch.is_tensor(a):
        return (
            torch.is_tensor(b)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(torch.nan_to_num(a.float(), nan=12345.0), torch.nan_to_num(b.float(), nan=12345.0))
        )
    if isinstance(a, float) and math.isnan(a):
        return isinstance(b, float) and math.isnan(b)
    if isinstance(a, dict):
        return isinstance(b, dict) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b and str(a) == str(b)  # str: -0.0 stays -0.0


def test_meta_round_trips_through_json(tmp_path):
    raw = meta_json.dumps(_meta(), [DataConfig])
    json.loads(raw)  # plain JSON: no NaN/Infinity literals, readable by any JSON reader
    assert b"NaN" not in raw and b"Infinity" not in raw
    back = meta_json.loads(raw, [DataConfig])
    assert _same(_meta(), back)
    assert isinstance(back["hyper_parameters"]["config"], ml.GPTConfig)
    (tmp_path / "meta.json").write_bytes(raw)
    assert _same(read_checkpoint_meta(tmp_path, [DataConfig]), _meta())


def test_unknown_configs_are_refused_or_read_as_plain_dicts():
    raw = meta_json.dumps({"hyper_parameters": {"data": DataConfig()}}, [DataConfig])
    with pytest.raises(CheckpointMetaError, match=r"test_checkpoint_meta.DataConfig, which is not one of the config"):
        meta_json.loads(raw)
    plain = meta_json.loads(raw, allowed=None, unknown_classes="dict")
    assert plain["hyper_parameters"]["data"] == {
        "__class__": f"{__name__}.DataConfig",
        "path": "corpus",
        "weights": (0.5, 0.5),
    }


@pytest.mark.parametrize(
    "value, message",
    [
        (object(), r"checkpoint.hyper_parameters.tokenizer is a builtins.object"),
        (DataConfig(), r"a dataclass that is not one of the module's config classes"),
        (torch.zeros(5000), r"tensor of 5000 elements.*at most 4096"),
        (torch.zeros(2, dtype=torch.complex64), r"complex64"),
        ({1, 2}, r"builtins.set"),
    ],
)
def test_what_json_cannot_hold_is_refused_when_written(value, message):
    with pytest.raises(CheckpointMetaError, match=message) as error:
        meta_json.dumps({"hyper_parameters": {"tokenizer": value}})
    assert "never pickled" in str(error.value) or "DCP shards" in str(error.value)


def test_a_crafted_meta_json_imports_and_runs_nothing(tmp_path, monkeypatch):
    """A meta.json naming a class of a module whose import would run code: refused, never imported."""
    marker = tmp_path / "pwned"
    (tmp_path / "evil_module.py").write_text(f"open({str(marker)!r}, 'w').close()\nclass Config:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    crafted = [
        {"__dataclass__": {"class": "evil_module.Config", "fields": {}}},
        {"__dataclass__": {"class": "os.system", "fields": {"command": f"touch {marker}"}}},
        {"__dataclass__": {"class": "subprocess.Popen", "fields": {"args": ["touch", str(marker)]}}},
        {"__dtype__": "__class__"},
        {"__tensor__": {"dtype": "float32", "shape": [3], "data": [1.0]}},
        {"__float__": "__import__('os')"},
    ]
    for payload in crafted:
        raw = json.dumps({"format": meta_json.FORMAT, "meta": {"hyper_parameters": payload}}).encode()
        (tmp_path / "meta.json").write_bytes(raw)
        with pytest.raises(CheckpointMetaError):
            read_checkpoint_meta(tmp_path, [ml.GPTConfig])
        inspected = meta_json.loads(raw, allowed=None, unknown_classes="dict") if "__dataclass__" in payload else None
        assert inspected is None or inspected["hyper_parameters"]["__class__"] == payload["__dataclass__"]["class"]
    assert not marker.exists() and "evil_module" not in sys.modules


def test_damaged_or_foreign_meta_json_is_a_clear_error(tmp_path):
    (tmp_path / "meta.json").write_bytes(b'{"format": "megatron-lite-meta/1", "meta": {"glob')
    with pytest.raises(CheckpointMetaError, match=r"meta.json is not valid JSON.*damaged"):
        read_checkpoint_meta(tmp_path)
    (tmp_path / "meta.json").write_text('{"epoch": 1}')
    with pytest.raises(CheckpointMetaError, match=r"not a megatron-lite checkpoint metadata file"):
        read_checkpoint_meta(tmp_path)


@pytest.mark.parametrize("depth", [200_000, 600])  # past the JSON parser's recursion limit; past the decoder's
def test_a_deeply_nested_meta_json_is_a_clear_error(tmp_path, depth):
    nested = "[" * depth + "]" * depth
    (tmp_path / "meta.json").write_text(f'{{"format": "{meta_json.FORMAT}", "meta": {{"loops": {nested}}}}}')
    with pytest.raises(
        CheckpointMetaError,
        match=rf"^{re.escape(str(tmp_path / 'meta.json'))} is malformed: it "
        r"nests deeper than a checkpoint's metadata does",
    ):
        read_checkpoint_meta(tmp_path)


@pytest.mark.parametrize(
    "tensor",
    [
        {"dtype": "float32", "shape": [1], "data": [[1.0, 2.0]]},
        {"dtype": "float32", "shape": [1], "data": ["a"]},
        {"dtype": "float32", "shape": [1], "data": [None]},
        {"dtype": "float32", "shape": [1], "data": [{"__dtype__": "int8"}]},
        {"dtype": "int8", "shape": [1], "data": [100000]},
        {"dtype": "qint8", "shape": [1], "data": [1]},
    ],
)
def test_a_crafted_inline_tensor_is_a_clear_error(tmp_path, tensor):
    (tmp_path / "meta.json").write_text(json.dumps({"format": meta_json.FORMAT, "meta": {"t": {"__tensor__": tensor}}}))
    with pytest.raises(CheckpointMetaError, match=rf"^{re.escape(str(tmp_path / 'meta.json'))}: meta\.t: tensor "):
        read_checkpoint_meta(tmp_path)


# --- checkpoints written before meta.json: meta.pt -----------------------------------------------
def test_legacy_meta_pt_loads_allowed_configs(tmp_path):
    config = ml.GPTConfig(num_layers=2)
    torch.save(
        {"hyper_parameters": {"config": config, "data": DataConfig(), "seed": 3}, "global_step": 5},
        tmp_path / "meta.pt",
    )
    meta = read_checkpoint_meta(tmp_path, [DataConfig])
    assert meta["hyper_parameters"]["config"] == config and meta["global_step"] == 5
    with pytest.raises(ValueError, match="DataConfig"):
        read_checkpoint_meta(tmp_path)  # not on the allow-list: refused, not unpickled


def test_a_crafted_legacy_meta_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"hyper_parameters": Payload(marker)}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match="never unpickles arbitrary objects"):
        read_checkpoint_meta(tmp_path, [ml.GPTConfig])
    assert not marker.exists()


def test_no_meta_is_empty(tmp_path):
    assert read_checkpoint_meta(tmp_path) == {}

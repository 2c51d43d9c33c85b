"""A checkpoint's metadata (meta.pt) is read with weights_only=True: configs we allow come back, anything
else is refused with a message, and a crafted file runs no code."""
import pytest
import torch

import megatron_lite as ml
from megatron_lite.core.checkpoint.sharded import read_checkpoint_meta


class Payload:
    """What an attacker would put in a downloaded checkpoint: code that runs when unpickled."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def test_allowed_configs_load(tmp_path):
    config = ml.GPTConfig(num_layers=2)
    torch.save({"hyper_parameters": {"config": config, "seed": 3}, "global_step": 5}, tmp_path / "meta.pt")
    meta = read_checkpoint_meta(tmp_path, [ml.GPTConfig])
    assert meta["hyper_parameters"]["config"] == config and meta["global_step"] == 5
    with pytest.raises(ValueError, match="GPTConfig"):
        read_checkpoint_meta(tmp_path)  # not on the allow-list: refused, not unpickled


def test_a_crafted_meta_runs_no_code(tmp_path):
    marker = tmp_path / "pwned"
    torch.save({"hyper_parameters": Payload(marker)}, tmp_path / "meta.pt")
    with pytest.raises(ValueError, match="never unpickles arbitrary objects"):
        read_checkpoint_meta(tmp_path, [ml.GPTConfig])
    assert not marker.exists()


def test_no_meta_is_empty(tmp_path):
    assert read_checkpoint_meta(tmp_path) == {}

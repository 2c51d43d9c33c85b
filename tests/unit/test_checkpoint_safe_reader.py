"""DCP checkpoints are read without unpickling arbitrary objects: `.metadata` through an allow-list
unpickler, non-tensor entries with weights_only=True. Real checkpoints (model, Adam state, bf16, plain
values) read exactly as torch's own reader reads them; crafted ones are refused and run nothing."""

import pickle
import re

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch import nn

from megatron_lite.core.checkpoint.errors import UnsafeCheckpointError
from megatron_lite.core.checkpoint.format.integrity import MANIFEST, manifest_bytes, record_file
from megatron_lite.core.checkpoint.format.safe_reader import SafeFileSystemReader, read_dcp_metadata
from megatron_lite.core.checkpoint.format.sharded import checkpoint_keys, load_sharded, save_sharded
from megatron_lite.core.checkpoint.full.reader import read_model_tensors
from megatron_lite.core.checkpoint.resume.rng import rng_placeholders
from megatron_lite.core.checkpoint.state import sharded_model_state, sharded_optimizer_state
from megatron_lite.core.parallel.layout import ParallelLayout


class Payload:
    """Code that runs when unpickled: creates the marker file."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (open, (str(self.marker), "w"))


def _trained_state():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.Linear(16, 4))
    model[1].to(torch.bfloat16)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    model[1](model[0](torch.randn(3, 8)).to(torch.bfloat16)).float().sum().backward()
    optimizer.step()
    layout = ParallelLayout.single()
    return {
        "model": sharded_model_state(model, layout),
        "optimizer_0": {
            k: v for k, v in sharded_optimizer_state(model, optimizer, layout).items() if k != "param_groups"
        },
        "extra": {"skipped_steps": 3, "loss_scaler": {"scale": 65536.0}},
    }


def test_real_checkpoints_read_as_torch_reads_them(tmp_path):
    state = _trained_state()
    save_sharded(state, tmp_path / "ckpt")
    ours = read_dcp_metadata(tmp_path / "ckpt" / ".metadata")
    theirs = dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert ours.state_dict_metadata == theirs.state_dict_metadata
    assert ours.storage_data == theirs.storage_data and ours.planner_data == theirs.planner_data
    dtypes = {m.properties.dtype for m in ours.state_dict_metadata.values() if hasattr(m, "properties")}
    assert dtypes == {torch.float32, torch.bfloat16}
    assert SafeFileSystemReader(str(tmp_path / "ckpt")).read_metadata().state_dict_metadata == ours.state_dict_metadata

    # and a load restores every value, the non-tensor entries (read with weights_only=True) included
    target = _trained_state()
    for group in ("model", "optimizer_0"):
        for value in target[group].values():
            if torch.is_tensor(value):
                value.zero_()
    target["extra"] = {"skipped_steps": 0, "loss_scaler": {"scale": 0.0}}
    load_sharded(target, tmp_path / "ckpt")
    for group in ("model", "optimizer_0"):
        for key, value in state[group].items():
            assert torch.equal(target[group][key], value), key
    assert target["extra"] == {"skipped_steps": 3, "loss_scaler": {"scale": 65536.0}}


def test_a_crafted_metadata_file_runs_no_code(tmp_path):
    save_sharded({"w": torch.ones(3)}, tmp_path / "ckpt")
    marker = tmp_path / "pwned"
    (tmp_path / "ckpt" / ".metadata").write_bytes(pickle.dumps(Payload(marker)))
    (tmp_path / "ckpt" / "manifest.json").unlink()  # as a crafted download would come: nothing to check against
    (tmp_path / "ckpt" / "meta.json").unlink()
    for read in (
        lambda: read_dcp_metadata(tmp_path / "ckpt" / ".metadata"),
        lambda: checkpoint_keys(tmp_path / "ckpt"),
        lambda: rng_placeholders(tmp_path / "ckpt", 0),
        lambda: load_sharded({"w": torch.zeros(3)}, tmp_path / "ckpt"),
    ):
        with pytest.raises(UnsafeCheckpointError, match=r"refers to (builtins|io)\.open.*does not unpickle it"):
            read()
    assert not marker.exists()
    # the file is a live payload: torch's own reader (a plain pickle.load) runs it
    dcp.FileSystemReader(str(tmp_path / "ckpt")).read_metadata()
    assert marker.exists()


def test_a_crafted_non_tensor_entry_runs_no_code(tmp_path):
    """DCP writes non-tensor values with torch.save and its default planner reads them back with
    weights_only=False; ours reads them with weights_only=True."""
    marker = tmp_path / "pwned"
    save_sharded({"w": torch.ones(3), "extra": Payload(marker)}, tmp_path / "ckpt")
    with pytest.raises(
        UnsafeCheckpointError, match=r"entry 'extra' holds objects outside plain data \((builtins|io)\.open\)"
    ) as error:
        load_sharded({"w": torch.zeros(3), "extra": None}, tmp_path / "ckpt")
    assert "weights_only" not in str(error.value)  # never torch's advice to load it with weights_only=False
    assert not marker.exists()


def _rewrite_manifest(directory):
    """What a crafted download comes with: a manifest that matches its files."""
    files = [p.name for p in directory.iterdir() if p.name != MANIFEST]
    (directory / MANIFEST).write_bytes(manifest_bytes({name: record_file(directory / name) for name in files}))


@pytest.mark.parametrize("crafted", ["a pickle payload", "garbage"])
def test_a_crafted_tensor_entry_is_one_clear_error(tmp_path, crafted):
    """The bytes of a tensor entry in a .distcp file replaced (and the manifest rewritten to match): every reader
    says the checkpoint is malformed, naming the file and the entry, runs nothing, and never repeats torch's
    advice to retry with weights_only=False."""
    marker = tmp_path / "pwned"
    ckpt = tmp_path / "ckpt"
    save_sharded({"model": {"w": torch.ones(64)}}, ckpt, extra={"hyper_parameters": {}})
    (info,) = [i for k, i in read_dcp_metadata(ckpt / ".metadata").storage_data.items() if k.fqn == "model.w"]
    payload = pickle.dumps(Payload(marker)) if crafted == "a pickle payload" else b"\x8a" * info.length
    data = (ckpt / info.relative_path).read_bytes()
    (ckpt / info.relative_path).write_bytes(
        data[: info.offset] + payload.ljust(info.length, b"\0")[: info.length] + data[info.offset + info.length :]
    )
    _rewrite_manifest(ckpt)
    message = (
        rf"^{re.escape(str(ckpt / info.relative_path))}: checkpoint entry 'model\.w' cannot be read \(.*\); the "
        rf"checkpoint is malformed"
    )
    for read in (
        lambda: load_sharded({"model": {"w": torch.zeros(64)}}, ckpt),
        lambda: read_model_tensors(ckpt, prefix=""),
    ):
        with pytest.raises(UnsafeCheckpointError, match=message) as error:
            read()
        assert "weights_only" not in str(error.value)
    assert not marker.exists()


def test_storage_paths_outside_the_checkpoint_are_refused(tmp_path):
    save_sharded({"w": torch.ones(3)}, tmp_path / "ckpt")
    metadata = read_dcp_metadata(tmp_path / "ckpt" / ".metadata")
    for info in metadata.storage_data.values():
        info.relative_path = "../../elsewhere.distcp"
    crafted = tmp_path / "crafted"
    crafted.mkdir()
    with open(crafted / ".metadata", "wb") as file:
        pickle.dump(metadata, file)
    with pytest.raises(UnsafeCheckpointError, match=r"'../../elsewhere.distcp' is not a file name inside"):
        read_dcp_metadata(crafted / ".metadata")

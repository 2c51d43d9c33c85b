"""Checkpoints of a real TP2 Trainer run: `megatron-lite checkpoint inspect` reports step, consumed samples,
layout, configs, size and the checksum verdict (exit 0), names a damaged shard (exit 1) and refuses a path
that is not a checkpoint (exit 2); resuming from the damaged checkpoint fails with the file named; a
checkpoint in the previous format (meta.pt, no manifest) still resumes."""

import json
import sys
from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from megatron_lite.cli import main as cli
from megatron_lite.core.checkpoint.errors import CorruptCheckpointError
from megatron_lite.core.checkpoint.format.sharded import read_checkpoint_meta

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests" / "distributed"))
from parity_utils import run  # noqa: E402


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("run")
    run(
        out / "first",
        devices=2,
        tp=2,
        steps=3,
        callbacks=[ModelCheckpoint(dirpath=out / "ckpts", every_n_train_steps=3, save_last=True)],
    )
    return out / "ckpts" / "last.ckpt"


def _inspect(capsys, *args) -> tuple[int, str, str]:
    with pytest.raises(SystemExit) as exit_:
        cli(["checkpoint", "inspect", *map(str, args)])
    captured = capsys.readouterr()
    return exit_.value.code, captured.out, captured.err


def test_inspect_a_good_checkpoint(checkpoint, capsys):
    code, out, _ = _inspect(capsys, checkpoint)
    assert code == 0
    lines = dict(line.split(None, 1) for line in out.splitlines() if line.strip() and not line.startswith(" "))
    assert lines["step"] == "3 (epoch 0)" and lines["consumed"] == "24 samples (MockGPTDataModule state)"
    assert lines["layout"].startswith("tp=2, sequence_parallel=False, pp=1, vpp=1, ranks=2")
    assert lines["config"].startswith("GPTConfig(num_layers=2, hidden_size=64,")
    assert lines["optimizer"].startswith("OptimizerConfig(optimizer='adam', lr=0.001")
    assert lines["checksums"].startswith("ok (4 files") and lines["metadata"] == "meta.json"

    code, out, _ = _inspect(capsys, checkpoint, "--json")
    info = json.loads(out)
    assert code == 0 and info["global_step"] == 3 and info["consumed_samples"] == 24
    assert info["layout"]["tensor_model_parallel_size"] == 2 and info["checksums"]["status"] == "ok"
    assert info["hyper_parameters"]["config"]["__class__"] == "megatron_lite.core.models.config.GPTConfig"
    assert info["size_bytes"] == sum(p.stat().st_size for p in checkpoint.iterdir())
    assert info["model_parameters"] > 0

    code, out, _ = _inspect(capsys, checkpoint.parent, "--json")  # a directory of checkpoints: its latest
    assert code == 0 and json.loads(out)["path"] == str(checkpoint)


def test_a_damaged_checkpoint_is_named_by_inspect_and_refused_by_fit(checkpoint, tmp_path, capsys):
    damaged = tmp_path / "damaged.ckpt"
    damaged.mkdir()
    for f in checkpoint.iterdir():
        (damaged / f.name).write_bytes(f.read_bytes())
    shard = damaged / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x10
    shard.write_bytes(data)

    code, out, _ = _inspect(capsys, damaged)
    assert code == 1 and "checksums   CORRUPT" in out and "__1_0.distcp: checksum mismatch" in out

    with pytest.raises(CorruptCheckpointError, match=r"__1_0.distcp: checksum mismatch") as error:
        run(tmp_path / "resumed", devices=2, tp=2, steps=5, ckpt_path=str(damaged))
    assert "nothing was loaded" in str(error.value)


def test_not_a_checkpoint(tmp_path, capsys):
    code, _, err = _inspect(capsys, tmp_path / "nothing")
    assert code == 2 and f"no checkpoint at {tmp_path / 'nothing'}" in err
    code, _, err = _inspect(capsys, tmp_path)
    assert code == 2 and "is not a megatron-lite checkpoint (no DCP .metadata inside)" in err


def test_a_checkpoint_in_the_previous_format_still_resumes(checkpoint, tmp_path, capsys):
    """Written before meta.json and manifests: meta.pt (read with weights_only=True), no checksums."""
    legacy = tmp_path / "legacy.ckpt"
    legacy.mkdir()
    for f in checkpoint.iterdir():
        if f.name not in ("meta.json", "manifest.json"):
            (legacy / f.name).write_bytes(f.read_bytes())
    torch.save(read_checkpoint_meta(checkpoint), legacy / "meta.pt")
    code, out, _ = _inspect(capsys, legacy)
    assert code == 0 and "unverified (no manifest.json" in out and "metadata    meta.pt" in out
    from_legacy = run(tmp_path / "from_legacy", devices=2, tp=2, steps=5, ckpt_path=str(legacy))
    from_current = run(tmp_path / "from_current", devices=2, tp=2, steps=5, ckpt_path=str(checkpoint))
    assert from_legacy["global_step"] == 5 and len(from_legacy["losses"]) == 2
    assert from_legacy["losses"] == from_current["losses"]

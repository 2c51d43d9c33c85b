"""The ``megatron-lite`` command starts without Lightning wherever a verb does not need it: ``--help`` and every
tool's parser, and real runs of ``checkpoint inspect``, ``convert --to hf`` and ``preprocess``. Each runs as the
command (``python -X importtime -m megatron_lite ...``, or with the console script's ``sys.argv``), and the modules
it imported are read from Python's import-time report (or ``sys.modules``). (``import megatron_lite`` in any other
program still registers the strategy, which imports Lightning: every ``Trainer(strategy="megatron")`` test checks
that.)"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import megatron_lite as ml
from megatron_lite.pretrained import save_weights_checkpoint

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("lightning", "jsonargparse")
"""Packages (and their modules) a light verb must not import."""


def _command(*args: str, cwd: Path = REPO) -> tuple[subprocess.CompletedProcess, set[str]]:
    """Run ``megatron-lite ARGS``; (the process, the modules it imported)."""
    proc = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "megatron_lite", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    # the report names what `import` statements imported (not importlib.import_module: the verb's own module)
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert "megatron_lite" in imported, proc.stderr[-2000:]  # the report was read
    return proc, imported


def _heavy(imported: set[str]) -> list[str]:
    return sorted(m for m in imported if m.split(".")[0] in HEAVY)


def test_help_imports_no_lightning() -> None:
    proc, imported = _command("--help")
    assert proc.returncode == 0 and "usage: megatron-lite" in proc.stdout, proc.stderr[-2000:]
    assert not _heavy(imported), _heavy(imported)
    # every tool's module and parser (what `megatron-lite TOOL --help` runs), in one process started as the
    # console script is (its sys.argv[0] is the script's path)
    code = f"""
import importlib, json, sys
sys.argv = [{str(Path(sys.executable).parent / "megatron-lite")!r}, "--help"]
from megatron_lite.cli import TOOLS
for verb in TOOLS.values():
    importlib.import_module(verb.module).build_parser().format_help()
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})))
"""
    proc = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=300,
        env={**os.environ, "PYTHONPATH": str(REPO)},
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == []


def test_the_light_tools_run_without_lightning(tmp_path: Path) -> None:
    module = ml.GPTModule(
        ml.GPTConfig(num_layers=1, hidden_size=16, num_attention_heads=2, vocab_size=64, seq_length=8)
    )
    module.configure_model()
    checkpoint = save_weights_checkpoint(module, tmp_path / "ckpt")
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text('{"text": "1 2 3"}\n{"text": "4 5"}\n')
    runs = {
        "inspect": ["checkpoint", "inspect", str(checkpoint), "--json"],
        "convert": ["convert", "--to", "hf", "--input", str(checkpoint), "--output", str(tmp_path / "hf")],
        "preprocess": [
            "preprocess",
            "--input",
            str(corpus),
            "--tokenizer-type",
            "NullTokenizer",
            "--vocab-size",
            "64",
            "--output-prefix",
            str(tmp_path / "corpus"),
        ],
    }
    out = {}
    for name, args in runs.items():
        proc, imported = _command(*args)
        assert proc.returncode == 0, (name, proc.stderr[-3000:])
        assert not _heavy(imported), (name, _heavy(imported))
        out[name] = proc.stdout
    info = json.loads(out["inspect"])  # and each did its work
    assert info["checksums"]["status"] == "ok" and info["files"] > 0
    assert (tmp_path / "hf" / "config.json").is_file() and (tmp_path / "corpus_text_document.idx").is_file()

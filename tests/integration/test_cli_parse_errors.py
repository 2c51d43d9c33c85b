"""A mistake the CLI's parser finds (a misspelled option or init arg, an unknown class, a value of the wrong type)
prints one line naming the option, the problem, the closest valid name and `--help`, and exits 2: not the ~66
lines of usage and nested Union report jsonargparse prints."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from megatron_lite.cli import main

CONFIG = str(Path(__file__).resolve().parents[2] / "examples/configs/gpt_tiny.yaml")


@pytest.fixture(autouse=True)
def _no_pytest_argv(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sys, "argv", ["megatron-lite"])  # LightningCLI warns when it also sees pytest's arguments


@pytest.mark.parametrize(
    "args, line",
    [
        (
            ["--model.optimizer.lrr", "0.1"],
            "unknown option --model.optimizer.lrr: GPTModule has no such argument (did you mean --model.optimizer.lr?)",
        ),
        (
            ["--data.init_args.vocab_sise", "512"],
            "unknown option --data.vocab_sise: TextCorpusDataModule has no such "
            "argument (did you mean --data.vocab_size?)",
        ),
        (["--trainer.maxx_steps", "3"], "unknown option --trainer.maxx_steps (did you mean --trainer.max_steps?)"),
        (
            ["--trainer.callbacks+=ModelChekpoint"],
            "--trainer.callbacks: ModelChekpoint is neither a known class name "
            "nor an import path (did you mean ModelCheckpoint?); give the class's "
            "import path, e.g. package.module.ClassName",
        ),
        (["--model.optimizer.lr", "nan"], "--model.optimizer.lr expects a float, got 'nan'"),
        (
            ["--data", "megatron_lite.data.MockGPTDataModul"],
            "--data: megatron_lite.data has no MockGPTDataModul (did you mean megatron_lite.data.MockGPTDataModule?)",
        ),
    ],
)
def test_a_parser_mistake_is_one_line(args: list[str], line: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_info:
        main(["fit", "--config", CONFIG, *args])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"megatron-lite: error: {line}; see `megatron-lite fit --help`"]


def test_a_mistake_in_the_yaml_is_one_line_too(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    extra = tmp_path / "extra.yaml"
    extra.write_text("model:\n  optimizer:\n    lrr: 0.1\n")
    with pytest.raises(SystemExit):
        main(["validate", "--config", CONFIG, "--config", str(extra)])
    assert capsys.readouterr().err.strip().splitlines() == [
        "megatron-lite: error: unknown option --model.optimizer.lrr: GPTModule has no such argument (did you mean "
        "--model.optimizer.lr?); see `megatron-lite validate --help`"
    ]

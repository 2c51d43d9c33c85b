"""A bare install (no extras) works: the CLI's every ``--help``, ``import megatron_lite.data``, a 1-process fit on
mock data, and one line naming the extra wherever an optional package is needed.

The environment is a real virtualenv (``python -m venv``, no system site-packages) holding exactly what
``pip install megatron-lite`` installs: this project's wheel, built here and installed by pip, plus the
closure of its base requirements (``Requires-Dist`` without extras, followed through each dependency's
metadata). Those distributions are linked from the environment running the tests rather than downloaded,
so the test runs offline in seconds; ``pip check`` then proves the closure is complete, and
``importlib.util.find_spec`` that no optional package leaked in.
"""

from __future__ import annotations

import importlib.metadata as metadata
import json
import os
import shutil
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path
from zipfile import ZipFile

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from megatron_lite.utils.optional import OPTIONAL

REPO = Path(__file__).resolve().parents[2]
PROJECT_FILES = ("pyproject.toml", "README.md", "LICENSE")
DATA_EXTRA_LINE = 'needs the {!r} package: pip install "megatron-lite[data]"'
# one venv per module: keep its tests on one xdist worker (`make test` runs --dist loadgroup)
pytestmark = pytest.mark.xdist_group("bare_install")


def _build_wheel(dest: Path) -> tuple[Path, str]:
    """This checkout's wheel, built from a copy (no build/ or egg-info in the checkout); returns it and pip's log."""
    src = dest / "src"
    src.mkdir(parents=True)
    for name in PROJECT_FILES:
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(
        REPO / "megatron_lite",
        src / "megatron_lite",
        ignore=shutil.ignore_patterns("__pycache__", ".megatron_lite_cache"),
    )
    # no isolation and no index: the build backend (setuptools>=77) is the one torch already requires here
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "-v",
            "--no-deps",
            "--no-build-isolation",
            "--no-index",
            str(src),
            "-w",
            str(dest / "wheel"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (wheel,) = (dest / "wheel").glob("megatron_lite-*.whl")
    return wheel, proc.stdout + proc.stderr


def _wheel_metadata(wheel: Path) -> list[Requirement]:
    """The wheel's ``Requires-Dist`` entries."""
    with ZipFile(wheel) as zf:
        (name,) = [n for n in zf.namelist() if n.endswith(".dist-info/METADATA")]
        message = Parser().parsestr(zf.read(name).decode())
    return [Requirement(r) for r in message.get_all("Requires-Dist") or []]


def _closure(requirements: list[Requirement]) -> dict[str, metadata.Distribution]:
    """Installed distributions that ``requirements`` pull in, transitively (extras followed), by normalized name."""
    found: dict[str, metadata.Distribution] = {}
    seen: set[tuple[str, frozenset[str]]] = set()
    pending: list[tuple[Requirement, frozenset[str]]] = [(r, frozenset()) for r in requirements]
    while pending:
        req, active = pending.pop()  # active: the extras requested of the distribution that lists ``req``
        environments = [{"extra": e} for e in active] or [{"extra": ""}]
        if req.marker is not None and not any(req.marker.evaluate(env) for env in environments):
            continue
        key = (canonicalize_name(req.name), frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        dist = metadata.distribution(req.name)  # PackageNotFoundError: the test environment lacks a base dependency
        assert req.specifier.contains(dist.version, prereleases=True), f"{req}, but {dist.version} is installed"
        found[key[0]] = dist
        pending += [(Requirement(r), key[1]) for r in dist.requires or []]
    return found


def _link_into(site: Path, dist: metadata.Distribution) -> None:
    """Symlink the top-level files and directories of ``dist`` (from its RECORD) into ``site``."""
    root = Path(dist.locate_file(""))
    tops = {Path(str(f)).parts[0] for f in dist.files or [] if not str(f).startswith("..")}
    assert tops, f"{dist.metadata['Name']} has no RECORD; it cannot be linked"
    for top in tops:
        target = site / top
        if not target.exists() and (root / top).exists():  # namespace dirs shared by two distributions: once
            target.symlink_to(root / top)


def _run(cmd: list[str], cwd: Path, env: dict[str, str], timeout: int = 300) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


@dataclass
class BareInstall:
    """The venv, how to run in it, and what setting it up saw."""

    root: Path
    venv: Path
    site: Path
    env: dict[str, str]
    build_log: str
    requirements: list[Requirement]
    closure: set[str]
    help_without_jsonargparse: subprocess.CompletedProcess[str]
    pip_check: subprocess.CompletedProcess[str]

    def bin(self, name: str) -> str:
        return str(self.venv / "bin" / name)


@pytest.fixture(scope="module")
def bare(tmp_path_factory: pytest.TempPathFactory) -> BareInstall:
    """A venv with megatron-lite and its base requirements only. ``megatron-lite fit --help`` runs once before
    jsonargparse's distributions are linked in (the state ``pip install --no-deps megatron-lite`` leaves)."""
    root = tmp_path_factory.mktemp("bare")
    wheel, build_log = _build_wheel(root)
    requirements = _wheel_metadata(wheel)
    base = [r for r in requirements if r.marker is None]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    # no PYTHONPATH: a checkout on it would shadow the installed package (and count as installed to pip)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV", "PIP_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PATH=f"{venv / 'bin'}:{env.get('PATH', '')}")
    env.pop("MASTER_PORT", None)
    python = str(venv / "bin" / "python")
    site = Path(
        _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"], root, env).stdout.strip()
    )
    everything = _closure(base)
    cli_only = set(_closure([r for r in base if canonicalize_name(r.name) == "jsonargparse"]))
    cli_only -= set(_closure([r for r in base if canonicalize_name(r.name) != "jsonargparse"]))
    for name, dist in everything.items():
        if name not in cli_only:
            _link_into(site, dist)
    pip = [sys.executable, "-m", "pip", "--python", python]
    install = _run([*pip, "install", "--no-deps", "--no-index", str(wheel)], root, env)
    assert install.returncode == 0, install.stdout[-2000:] + install.stderr[-2000:]
    assert (venv / "bin" / "megatron-lite").is_file(), install.stdout[-2000:]
    help_without_jsonargparse = _run([str(venv / "bin" / "megatron-lite"), "fit", "--help"], root, env)
    for name in sorted(cli_only):
        _link_into(site, everything[name])
    return BareInstall(
        root=root,
        venv=venv,
        site=site,
        env=env,
        build_log=build_log,
        requirements=requirements,
        closure=set(everything),
        help_without_jsonargparse=help_without_jsonargparse,
        pip_check=_run([*pip, "check"], root, env),
    )


def test_wheel_builds_without_licence_warnings_and_declares_its_extras(bare: BareInstall) -> None:
    """PEP 639 metadata: no setuptools deprecation warning; every optional module's package is in the extra that
    ``require()`` names, and none is a base requirement."""
    assert "deprecated" not in bare.build_log.lower(), bare.build_log[-3000:]
    base = {canonicalize_name(r.name) for r in bare.requirements if r.marker is None}
    for module, provider in OPTIONAL.items():
        extra_reqs = {
            canonicalize_name(r.name)
            for r in bare.requirements
            if r.marker is not None and r.marker.evaluate({"extra": provider.extra})
        }
        name = canonicalize_name(Requirement(provider.distribution).name)
        assert name in extra_reqs, f"{module}: {provider.distribution} is not in the {provider.extra!r} extra"
        assert name not in base, f"{module}: {provider.distribution} is a base requirement"


def test_bare_install_help_import_and_mock_fit(bare: BareInstall) -> None:
    """The issue's list: `megatron-lite --help` (and `fit --help`), `preprocess --help`, `estimate --help`,
    `import megatron_lite.data` and a 1-process fit on mock data, in a venv without any extra."""
    # without jsonargparse (as after `pip install --no-deps`): one line naming the extra, not a traceback
    proc = bare.help_without_jsonargparse
    assert (proc.returncode, proc.stderr.strip()) == (
        2,
        (
            "megatron-lite: error: megatron-lite fit/validate/test/predict needs the "
            "'jsonargparse[signatures]>=4.27.7' "
            'package: pip install "megatron-lite[cli]"'
        ),
    ), proc.stdout + proc.stderr
    assert bare.pip_check.returncode == 0, bare.pip_check.stdout + bare.pip_check.stderr  # the closure is complete

    for args, expected in (
        (["--help"], "{fit,validate,test,predict}"),
        (["fit", "--help"], "--trainer.max_steps"),
        (["preprocess", "--help"], "--tokenizer-type"),
        (["estimate", "--help"], "--devices"),
    ):
        proc = _run([bare.bin("megatron-lite"), *args], bare.root, bare.env)
        assert proc.returncode == 0 and expected in proc.stdout, (args, proc.stdout[-2000:], proc.stderr[-3000:])
    # the installed console script starts a tool without Lightning; Python's import-time report names what the
    # `import` statements imported (the verb's own module comes through importlib, which it does not time)
    proc = _run(
        [bare.bin("python"), "-X", "importtime", bare.bin("megatron-lite"), "checkpoint", "inspect", "--help"],
        bare.root,
        bare.env,
    )
    imported = {line.rsplit("|", 1)[1].strip() for line in proc.stderr.splitlines() if line.startswith("import time:")}
    assert proc.returncode == 0 and "megatron_lite.core.checkpoint.format.inspect" in imported, proc.stderr[-3000:]
    assert not [m for m in imported if m.split(".")[0] in ("lightning", "jsonargparse")], sorted(imported)

    # the optional packages really are absent (not tqdm: Lightning needs it), the installed package (not the
    # checkout) is what runs, and it trains
    absent = sorted(m for m, p in OPTIONAL.items() if canonicalize_name(p.distribution) not in bare.closure)
    assert {"sentencepiece", "tokenizers", "tiktoken", "matplotlib", "tensorboard"} <= set(absent)
    script = bare.root / "fit_mock.py"
    script.write_text(
        textwrap.dedent(f"""
        import importlib.util, json, sys
        import lightning as L
        import megatron_lite as ml
        import megatron_lite.data
        from lightning.pytorch.loggers import CSVLogger

        present = [m for m in {absent!r} if importlib.util.find_spec(m)]
        config = ml.GPTConfig(num_layers=1, hidden_size=32, num_attention_heads=2, vocab_size=256, seq_length=16)
        trainer = L.Trainer(strategy="megatron", accelerator="cpu", devices=1, max_steps=3, log_every_n_steps=1,
                            logger=CSVLogger(sys.argv[1]), enable_checkpointing=False, enable_progress_bar=False,
                            callbacks=[ml.callbacks.MegatronMetrics()])
        data = megatron_lite.data.MockGPTDataModule(seq_length=16, micro_batch_size=2, global_batch_size=4,
                                                    vocab_size=256)
        trainer.fit(ml.GPTModule(config), data)
        print(json.dumps({{"present": present, "file": ml.__file__, "step": trainer.global_step,
                          "loss": float(trainer.callback_metrics["train/loss"])}}))
    """)
    )
    proc = _run([bare.bin("python"), str(script), str(bare.root / "run")], bare.root, bare.env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["present"] == [] and result["file"].startswith(str(bare.site)), result
    assert result["step"] == 3 and 5.0 < result["loss"] < 6.0, result  # ~ln(256) = 5.5 for a fresh model


@pytest.mark.slow
def test_bare_install_names_the_extra_where_one_is_needed(bare: BareInstall) -> None:
    """Where an optional package is needed: one line naming the extra, exit 2, no traceback."""
    corpus = bare.root / "corpus.jsonl"
    corpus.write_text('{"text": "to be or not to be"}\n')
    run_dir = bare.root / "csv-run"
    (run_dir / "version_0").mkdir(parents=True)
    (run_dir / "version_0" / "metrics.csv").write_text("step,train/loss\n0,5.5\n1,5.4\n")
    cases = [
        (
            ["fit", "--config", str(REPO / "examples/configs/gpt_tiny.yaml")],
            "megatron-lite: error: TextCorpusDataModule " + DATA_EXTRA_LINE.format("sentencepiece"),
        ),
        (
            [
                "preprocess",
                "--input",
                str(corpus),
                "--output-prefix",
                str(bare.root / "out"),
                "--tokenizer-type",
                "GPT2BPETokenizer",
                "--vocab-file",
                "vocab.json",
                "--merge-file",
                "merges.txt",
            ],
            "megatron-lite preprocess: error: GPT2BPETokenizer " + DATA_EXTRA_LINE.format("tokenizers"),
        ),
        (
            ["plot", str(run_dir)],
            "megatron-lite plot: error: megatron-lite plot needs the 'matplotlib' package: "
            'pip install "megatron-lite[logging]"',
        ),
    ]
    for args, line in cases:
        proc = _run([bare.bin("megatron-lite"), *args], bare.root, bare.env)
        assert (proc.returncode, proc.stderr.strip().splitlines()[-1:]) == (2, [line]), (args, proc.stderr[-3000:])
        assert "Traceback" not in proc.stderr, proc.stderr[-3000:]

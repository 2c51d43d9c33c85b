"""Optional dependencies are imported where they are used (one line naming the extra when missing), and
``ml.data`` / ``ml.callbacks`` / ``ml.tokenizers`` are attributes of ``import megatron_lite`` without being
imported up front. The bare-install test (tests/integration/test_bare_install.py) runs the same in a venv
that really lacks the extras."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from megatron_lite.tokenizers import SentencePieceTokenizer, TikTokenizer, build_tokenizer
from megatron_lite.utils.optional import OPTIONAL, MissingDependencyError, Provider, require

TOKENIZERS = Path(__file__).resolve().parents[1] / "data" / "tokenizers"  # real files: only the package is missing
LAZY = ("megatron_lite.callbacks", "megatron_lite.data", "megatron_lite.tokenizers")
# what the data extra brings; Lightning itself imports tqdm (and torchmetrics matplotlib, when installed)
DATA_ONLY = ("sentencepiece", "tokenizers", "tiktoken", "pyarrow", "datasets")


def test_require_returns_the_module() -> None:
    import tokenizers

    assert require("tokenizers", "x") is tokenizers
    assert require("pyarrow.parquet", "x").__name__ == "pyarrow.parquet"


def test_a_missing_package_is_one_line_naming_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    for module in ("sentencepiece", "tiktoken", "tokenizers"):
        monkeypatch.setitem(sys.modules, module, None)  # what `import` sees when the package is not installed
    cases = [
        (
            lambda: SentencePieceTokenizer(str(TOKENIZERS / "llama-sp/tokenizer.model")),
            "SentencePieceTokenizer",
            "sentencepiece",
        ),
        (
            lambda: build_tokenizer(
                "gpt2", vocab_file=TOKENIZERS / "gpt2/vocab.json", merge_file=TOKENIZERS / "gpt2/merges.txt"
            ),
            "GPT2BPETokenizer",
            "tokenizers",
        ),
        (lambda: build_tokenizer("hf", tokenizer_model=TOKENIZERS / "gpt2"), "HuggingFaceTokenizer", "tokenizers"),
        (lambda: TikTokenizer(TOKENIZERS / "gpt2/vocab.json"), "TikTokenizer", "tiktoken"),
    ]
    for make, purpose, package in cases:
        with pytest.raises(MissingDependencyError) as info:
            make()
        assert str(info.value) == f'{purpose} needs the {package!r} package: pip install "megatron-lite[data]"'
        assert isinstance(info.value, ImportError) and info.value.__suppress_context__  # no chained traceback


def test_only_the_package_itself_missing_is_reported_as_an_extra(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An installed optional package that fails on a dependency of its own keeps that error: "install the extra"
    would be wrong advice."""
    (tmp_path / "halfbroken").mkdir()
    (tmp_path / "halfbroken" / "__init__.py").write_text("import a_module_nobody_has_installed\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    for name in ("halfbroken", "not_installed_at_all"):
        monkeypatch.setitem(OPTIONAL, name, Provider(name.replace("_", "-"), "logging"))
    with pytest.raises(ModuleNotFoundError, match="a_module_nobody_has_installed") as info:
        require("halfbroken", "plotting")
    assert not isinstance(info.value, MissingDependencyError)
    with pytest.raises(
        MissingDependencyError,
        match=r"^plotting needs the 'not-installed-at-all' package: "
        r"pip install \"megatron-lite\[logging\]\"$",
    ):
        require("not_installed_at_all", "plotting")
    with pytest.raises(KeyError):
        require("an_unlisted_package", "x")  # every optional dependency is declared in OPTIONAL


def _fresh_python(code: str) -> dict:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_subpackages_are_lazy_attributes() -> None:
    result = _fresh_python(f"""
import json, sys
import megatron_lite as ml
eager = [m for m in {LAZY!r} if m in sys.modules]
# Lightning imports torchmetrics, which imports transformers (and with it tokenizers and sentencepiece)
# whenever transformers is installed: count only what our own code pulls in beyond that.
import lightning.pytorch, torchmetrics.functional
baseline = set(sys.modules)
metrics = ml.callbacks.MegatronMetrics()
data = ml.data.MockGPTDataModule(seq_length=8, micro_batch_size=1, global_batch_size=2, vocab_size=16)
tokenizer = ml.tokenizers.build_tokenizer("null", vocab_size=16)
try:
    ml.nope
except AttributeError as err:
    missing = str(err)
print(json.dumps(dict(eager=eager, metrics=type(metrics).__module__, data=type(data).__name__,
                      ids=tokenizer.tokenize("3 4"), same=ml.data is sys.modules["megatron_lite.data"],
                      listed=[n for n in ("callbacks", "data", "tokenizers") if n in dir(ml)], missing=missing,
                      optional_imported=[m for m in {DATA_ONLY!r} if m in sys.modules and m not in baseline])))
""")
    assert result["eager"] == [], "import megatron_lite must not import these (import time)"
    assert (result["metrics"], result["data"], result["ids"]) == (
        "megatron_lite.callbacks.metrics",
        "MockGPTDataModule",
        [3, 4],
    )
    assert result["same"] and result["listed"] == ["callbacks", "data", "tokenizers"]
    assert result["missing"] == "module 'megatron_lite' has no attribute 'nope'"
    assert result["optional_imported"] == [], "the data extra's packages are imported only where they are used"


def test_moved_modules_keep_their_old_names(monkeypatch: pytest.MonkeyPatch) -> None:
    """``megatron_lite.convert`` and the other verbs that moved into ``megatron_lite.cli`` still import, as the very
    module at the new place, with a DeprecationWarning naming it."""
    import importlib

    import megatron_lite
    from megatron_lite._moved_modules import MOVED

    for old, new in MOVED.items():
        monkeypatch.delitem(sys.modules, old, raising=False)
        monkeypatch.delitem(vars(megatron_lite), old.rpartition(".")[2], raising=False)  # (hasattr would import it)
        with pytest.warns(DeprecationWarning, match=f"{old} moved to {new}; import it from there"):
            module = importlib.import_module(old)
        assert module is importlib.import_module(new) and sys.modules[old] is module
    # the forms in use: `from megatron_lite.X import name`, `from megatron_lite import X`, `ml.X`
    from megatron_lite import convert
    from megatron_lite.pipeline_timeline import measured_bubble
    from megatron_lite.plot import main

    assert convert.to_hf.__module__ == "megatron_lite.cli.convert" and main.__module__ == "megatron_lite.cli.plot"
    assert measured_bubble.__module__ == "megatron_lite.core.parallel.pipeline.timeline"
    assert megatron_lite.quantize is sys.modules["megatron_lite.cli.quantize"]
    with pytest.raises(ModuleNotFoundError):
        importlib.import_module("megatron_lite.not_a_module")


def test_data_lists_every_lazy_name() -> None:
    import megatron_lite.data as data

    assert sorted(data.__all__) == sorted(data._PUBLIC) and set(data.__all__) <= set(dir(data))
    assert all(
        getattr(data, name).__module__ == module
        for name, module in data._PUBLIC.items()
        if hasattr(getattr(data, name), "__module__")
    )

"""Every Python snippet and every shell command of README.md and docs/*.md runs, at tiny sizes, or its page
says why it cannot (the conventions: docs_blocks.py). A renamed argument, a moved import or a changed CLI
flag in the library fails here, on the page and line that shows it.

Python snippets run in this process, page by page (ranks forked, as in a notebook); so do the commands
(docs_commands.py: the interpreter, its imports and ModelOpt's are paid once), each with what the test adds to
keep it tiny: ``fit`` gets ``--trainer.max_steps 2``, no LR warmup and one validation batch at the end,
``validate`` two batches, and both start their ranks by fork. A command that an example config's header shows
too is run once, by test_example_config_commands.py (config_headers.py says which).
"""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_workspace  # noqa: E402
from docs_blocks import all_blocks, run_python, runnable_commands, runnable_python  # noqa: E402
from docs_commands import cli_arguments, run_elsewhere, run_one  # noqa: E402

pytestmark = pytest.mark.xdist_group("docs_examples")  # one worker builds the workspace once for all of them

BLOCKS = all_blocks()
PYTHON_PAGES = sorted({block.page for block in runnable_python(BLOCKS)})
_LAUNCHING_VERBS = ("fit", "validate", "test", "predict")


@pytest.fixture(scope="module")
def workspace(tmp_path_factory) -> Path:
    return docs_workspace.build(tmp_path_factory.mktemp("docs") / "base")


@pytest.fixture(scope="module")
def cache_home(tmp_path_factory) -> Path:
    """The user cache the snippets and commands write (a tokenizer trained on the bundled corpus), not ~/.cache."""
    return tmp_path_factory.mktemp("cache")


@pytest.mark.parametrize("page", PYTHON_PAGES)
def test_python_snippets_run(page, workspace, cache_home, tmp_path, monkeypatch):
    monkeypatch.chdir(docs_workspace.copy(workspace, tmp_path / "ws"))
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    run_python([b for b in BLOCKS if b.page == page])


def added_arguments(argv: list[str]) -> list[str]:
    """What the test appends to a shown command to keep it tiny (later options win)."""
    args = cli_arguments(argv)
    verb = args[0] if args else None
    if verb not in _LAUNCHING_VERBS or "--print_config" in argv:
        return []
    added = ["--trainer.strategy.init_args.start_method", "fork"]  # no interpreter start per rank
    if verb == "fit":  # two steps, validated once at the end (on one batch)
        added += [
            "--trainer.max_steps",
            "2",
            "--model.optimizer.lr_warmup_iters",
            "0",
            "--trainer.num_sanity_val_steps",
            "0",
            "--trainer.val_check_interval",
            "2",
            "--trainer.limit_val_batches",
            "1",
        ]
    else:
        added += ["--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2"]
    return added


def test_shell_commands_run(workspace, cache_home, tmp_path, monkeypatch, capfd, record_property):
    monkeypatch.setenv("XDG_CACHE_HOME", str(cache_home))
    monkeypatch.delenv("MASTER_PORT", raising=False)
    cwd_of_page, failures, elsewhere = {}, [], []
    for block, argv in runnable_commands(BLOCKS):
        reason = run_elsewhere(argv)
        if reason:
            elsewhere.append(f"{block.where}: `{' '.join(argv)}`: {reason}")
            continue
        if block.page not in cwd_of_page:  # in page order, in a directory of its own per page
            cwd_of_page[block.page] = docs_workspace.copy(workspace, tmp_path / f"page{len(cwd_of_page)}")
        monkeypatch.chdir(cwd_of_page[block.page])
        capfd.readouterr()
        status = run_one(argv + added_arguments(argv))
        out, err = capfd.readouterr()  # the command's output and its forked ranks'
        if status != 0:
            failures.append(f"{block.where}: `{' '.join(argv)}` exited {status}\n{(out + err)[-3000:]}")
    record_property("run_elsewhere", elsewhere)
    print("\n".join(["not run here:", *elsewhere]))
    assert not failures, "\n\n".join(failures)

"""Every Python snippet and every shell command of README.md and docs/*.md runs, at tiny sizes, or its page
says why it cannot (the conventions: docs_blocks.py). A renamed argument, a moved import or a changed CLI
flag in the library fails here, on the page and line that shows it.

Python snippets run in this process, page by page (ranks forked, as in a notebook); the commands run in one
subprocess (docs_commands.py: one interpreter start for all of them, and this process keeps its state), each
with what the test adds to keep it tiny: ``fit`` gets ``--trainer.max_steps 2``, no LR warmup and one
validation batch at the end, ``validate`` two batches, and both start their ranks by fork.
"""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import docs_workspace  # noqa: E402
from docs_blocks import REPO, all_blocks, run_python, runnable_commands, runnable_python  # noqa: E402

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
    verb = argv[1] if argv[0] == "megatron-lite" else argv[3] if argv[:3] == ["python", "-m", "megatron_lite"] else None
    if verb not in _LAUNCHING_VERBS or "--print_config" in argv:
        return []
    added = ["--trainer.strategy.init_args.start_method", "fork"]  # no interpreter start per rank
    if verb == "fit":  # two steps, validated once at the end (on one batch)
        added += ["--trainer.max_steps", "2", "--model.optimizer.lr_warmup_iters", "0", "--trainer.num_sanity_val_steps",
                  "0", "--trainer.val_check_interval", "2", "--trainer.limit_val_batches", "1"]
    else:
        added += ["--trainer.limit_val_batches", "2", "--trainer.limit_test_batches", "2"]
    return added


def test_shell_commands_run(workspace, cache_home, tmp_path):
    commands = runnable_commands(BLOCKS)
    cwd_of_page = {}
    plan = []
    for i, (block, argv) in enumerate(commands):
        if block.page not in cwd_of_page:  # in page order, in a directory of its own per page
            cwd_of_page[block.page] = docs_workspace.copy(workspace, tmp_path / f"page{len(cwd_of_page)}")
        plan.append({"argv": argv + added_arguments(argv), "cwd": str(cwd_of_page[block.page]),
                     "log": str(tmp_path / f"command{i}.log")})
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", XDG_CACHE_HOME=str(cache_home))
    env.pop("MASTER_PORT", None)
    subprocess.run([sys.executable, str(REPO / "tests/integration/docs_commands.py"), str(tmp_path / "plan.json"),
                    str(tmp_path / "results.json")], env=env, timeout=540, check=False)
    results = json.loads((tmp_path / "results.json").read_text()) if (tmp_path / "results.json").exists() else []
    failures = []
    for i, ((block, argv), item) in enumerate(zip(commands, plan)):
        status = results[i]["status"] if i < len(results) else "not reached"
        if status != 0:
            log = Path(item["log"]).read_text(errors="replace")[-3000:] if Path(item["log"]).exists() else ""
            failures.append(f"{block.where}: `{' '.join(argv)}` exited {status}\n{log}")
    assert not failures, "\n\n".join(failures)

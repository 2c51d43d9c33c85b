"""The conventions the docs tests run the pages' code by (tests/integration/docs_blocks.py): every code block of
the README and docs/ is either run or says why not, the markers cannot go stale, and a snippet or command that
breaks fails (test_docs_examples.py runs them all)."""

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
from docs_blocks import Block, all_blocks, parse_page, run_python, runnable_commands  # noqa: E402
from docs_commands import run_elsewhere, run_one  # noqa: E402


def test_every_block_of_the_pages_has_a_language_and_valid_markers():
    blocks = all_blocks()  # a malformed marker raises here, naming its page and line
    assert blocks
    for block in blocks:
        assert block.lang, f"{block.where}: give the block a language (python, bash, console, text, ...)"
        if block.replacements:
            assert block.lang in ("python", "bash", "console"), f"{block.where}: run-with on a block that never runs"
            block.code_to_run()  # every OLD occurs
        if block.lang == "python" and block.not_run is None:
            compile(block.code_to_run(), block.where, "exec")
        if block.lang in ("bash", "console") and block.not_run is None:
            block.commands()  # every command line parses as a shell would split it


def test_the_pages_show_commands_and_snippets_that_run():
    blocks = all_blocks()
    assert sum(b.lang == "python" and b.not_run is None for b in blocks) >= 15
    assert len(runnable_commands(blocks)) >= 15
    readme = [b for b in blocks if b.page == "README.md"]
    assert readme[0].lang == "bash" and readme[0].code.startswith("make demo") and "make test" in readme[0].code
    assert readme[1].lang == "python" and readme[1].not_run is None  # the example runs


def _page(tmp_path, text: str) -> Path:
    path = tmp_path / "page.md"
    path.write_text(text)
    return path


def test_markers_are_checked(tmp_path):
    with pytest.raises(ValueError, match="page.md:2: <!-- not-run: --> needs the reason"):
        parse_page(_page(tmp_path, "<!-- not-run: -->\n```python\nx = 1\n```\n"))
    with pytest.raises(ValueError, match="unknown marker <!-- skip: -->"):
        parse_page(_page(tmp_path, "<!-- skip: why -->\n```python\nx = 1\n```\n"))
    with pytest.raises(ValueError, match="not 'OLD => NEW'"):
        parse_page(_page(tmp_path, "<!-- run-with:\nmax_steps=800\n-->\n```python\nx = 1\n```\n"))
    [block] = parse_page(
        _page(tmp_path, "<!-- run-with: max_steps=800 => max_steps=2 -->\n```python\nf(max_steps=80)\n```\n")
    )
    with pytest.raises(ValueError, match="page.md:2: run-with replaces 'max_steps=800', which the block does not"):
        block.code_to_run()  # a replacement that went stale fails rather than running the full size
    [block] = parse_page(_page(tmp_path, "<!-- not-run: needs 8 GPUs -->\n```bash\nmegatron-lite fit\n```\n"))
    assert block.not_run == "needs 8 GPUs" and runnable_commands([block]) == []


def test_commands_are_read_as_a_shell_reads_them():
    code = (
        "megatron-lite fit --config a.yaml \\\n    --data.init_args.paths [data/x]   # a comment\n"
        'pip install foo\nmegatron-lite generate --prompt "To be" [--devices 2 --tp 2] [--json]\n'
        "python examples/grpo.py --steps 2\n"
    )
    assert Block("p.md", 1, "bash", code).commands() == [
        ["megatron-lite", "fit", "--config", "a.yaml", "--data.init_args.paths", "[data/x]"],
        ["megatron-lite", "generate", "--prompt", "To be", "--devices", "2", "--tp", "2", "--json"],
        ["python", "examples/grpo.py", "--steps", "2"],
    ]
    console = "$ megatron-lite checkpoint inspect c.ckpt   # or --json\ncheckpoint  c.ckpt\nstep        3\n"
    assert Block("p.md", 1, "console", console).commands() == [["megatron-lite", "checkpoint", "inspect", "c.ckpt"]]


def test_a_broken_snippet_fails_naming_its_line(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    page = _page(
        tmp_path,
        "Text.\n\n```python\nconfig = ml.GPTConfig(num_layers=2)\n```\n\n"
        "```python\nml.GPTConfig(no_such_field=1)\n```\n",
    )
    with pytest.raises(AssertionError, match=r"page.md:7 fails: TypeError: .*no_such_field") as failure:
        run_python(parse_page(page))
    assert failure.value.__cause__.__traceback__.tb_next.tb_lineno == 8  # the page's own line


def test_a_broken_command_fails(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert run_one(["megatron-lite", "checkpoint", "inspect", str(tmp_path / "no_such.ckpt")]) != 0
    assert run_one(["megatron-lite", "fit", "--config", str(tmp_path / "no_such.yaml")]) != 0
    assert run_one(["python", "examples/no_such_example.py"]) == 1
    assert run_one(["megatron-lite", "estimate", "--help"]) == 0


def test_a_command_a_config_header_shows_is_left_to_the_header_test():
    """test_example_config_commands.py runs every command of the example configs' headers; the docs tests do not
    run one again where a page shows it, but do run anything that differs in what that test would run."""
    tiny = ["megatron-lite", "fit", "--config", "examples/configs/gpt_tiny.yaml"]
    assert "gpt_tiny.yaml's header" in run_elsewhere(tiny)
    assert run_elsewhere([*tiny, "--trainer.max_steps", "200"])  # both tests run 2 steps, whatever the page shows
    assert run_elsewhere(["python", "-m", "megatron_lite", *tiny[1:], "--ckpt_path", "last", "--trainer.max_steps=400"])
    assert "dpo.yaml's header" in run_elsewhere(["megatron-lite", "fit", "--config", "examples/configs/dpo.yaml"])
    assert run_elsewhere([*tiny, "--trainer.strategy.init_args.sequence_parallel", "true"]) is None
    assert run_elsewhere([*tiny, "--ckpt_path", "runs/tiny/checkpoints/last.ckpt"]) is None
    assert (
        run_elsewhere(
            [
                "megatron-lite",
                "estimate",
                "--config",
                "examples/configs/gpt_tiny.yaml",
                "--devices",
                "4",
                "--trainer.max_steps",
                "9",
            ]
        )
        is None
    )  # only a fit's max_steps is the header test's own
    assert run_elsewhere(["python", "examples/grpo.py", "--steps", "2"]) is None

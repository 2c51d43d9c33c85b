"""What every ``megatron-lite`` verb shares (``megatron_lite/cli/command.py``): a user error is one line and exit
code 2 (its traceback with ``MEGATRON_LITE_DEBUG``), anything else keeps its traceback, ``--json`` prints one JSON
document, a reader that left (``| head``) ends the verb quietly with 141; and the dispatch's own answers (``--help``
naming every verb, no verb, a misspelled verb) without importing any verb."""

from __future__ import annotations

import io
import json
import os
import sys

import pytest

from megatron_lite.cli import TOOLS, TRAINING, help_text, main
from megatron_lite.cli.command import (
    EXIT_BROKEN_PIPE,
    EXIT_FAILED,
    EXIT_OK,
    EXIT_USAGE,
    closing_quietly_on_broken_pipe,
    print_result,
    run_verb,
)
from megatron_lite.utils.optional import MissingDependencyError


def _fail(error: BaseException):
    def work():
        raise error

    return work


def test_a_user_error_is_one_line_and_exit_2(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("MEGATRON_LITE_DEBUG", raising=False)
    for error in (
        ValueError("--top-p must be in (0, 1],\n    got 1.5"),
        FileNotFoundError("--ckpt x does not exist"),
        MissingDependencyError("plotting needs the 'matplotlib' package"),
    ):
        assert run_verb("megatron-lite demo", _fail(error), print) == EXIT_USAGE
        captured = capsys.readouterr()
        assert captured.out == "" and captured.err == f"megatron-lite demo: error: {' '.join(str(error).split())}\n"
    # a verb may narrow what it reports: anything else is a bug, with its traceback
    with pytest.raises(TypeError, match="a bug"):
        run_verb("megatron-lite demo", _fail(TypeError("a bug")), print, errors=(ValueError,))
    with pytest.raises(KeyError):
        run_verb("megatron-lite demo", _fail(KeyError("also a bug")), print)


def test_debug_shows_the_traceback_of_a_user_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("MEGATRON_LITE_DEBUG", "1")
    with pytest.raises(ValueError, match="bad input"):
        run_verb("megatron-lite demo", _fail(ValueError("bad input")), print)


def test_the_result_is_printed_and_decides_the_exit_code(capsys: pytest.CaptureFixture[str]) -> None:
    result = {"path": "ckpt", "healthy": False}

    def show(info: dict) -> int:
        print_result(info, as_json=True, text=str, indent=2)
        return EXIT_OK if info["healthy"] else EXIT_FAILED

    assert run_verb("megatron-lite demo", lambda: result, show) == EXIT_FAILED
    assert json.loads(capsys.readouterr().out) == result
    assert run_verb("megatron-lite demo", lambda: result, lambda r: print_result(r, False, lambda r: "text")) == EXIT_OK
    assert capsys.readouterr().out == "text\n"


def test_a_reader_that_left_ends_the_verb_quietly(monkeypatch: pytest.MonkeyPatch) -> None:
    read, write = os.pipe()
    os.close(read)  # the reader is gone: `megatron-lite checkpoint inspect CKPT | head -0`
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.FileIO(write, "w"), write_through=False))

    def chatty() -> int:
        for _ in range(10_000):
            print("x" * 100)
        return EXIT_OK

    assert closing_quietly_on_broken_pipe(chatty) == EXIT_BROKEN_PIPE == 141
    sys.stdout.write("more")  # stdout now goes to /dev/null: Python's own flush at exit cannot fail either
    sys.stdout.flush()


def test_a_broken_pipe_elsewhere_is_not_hidden(monkeypatch: pytest.MonkeyPatch) -> None:
    read, write = os.pipe()  # stdout's reader is still there
    monkeypatch.setattr(sys, "stdout", io.TextIOWrapper(io.FileIO(write, "w")))
    try:
        with pytest.raises(BrokenPipeError):
            closing_quietly_on_broken_pipe(_fail(BrokenPipeError("a socket of the verb's own")))
    finally:
        os.close(read)


def test_the_dispatch_answers_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    assert out == help_text() + "\n" and "{fit,validate,test,predict}" in out
    assert all(f"  {verb} " in out for verb in (*TRAINING, *TOOLS))
    for args, line in (
        ([], "megatron-lite: error: name a verb: fit, validate, test, predict, preprocess"),
        (["fitt"], "megatron-lite: error: unknown verb 'fitt' (did you mean fit?); see `megatron-lite --help`"),
        (["conver", "--to", "hf"], "unknown verb 'conver' (did you mean convert?)"),
    ):
        with pytest.raises(SystemExit) as done:
            main(args)
        err = capsys.readouterr().err
        assert done.value.code == 2 and line in err and len(err.strip().splitlines()) == 1, err


def test_every_tool_names_a_module_with_a_main() -> None:
    import importlib

    for verb in TOOLS.values():
        assert callable(importlib.import_module(verb.module).main), verb


def test_the_lightning_cli_class_is_still_an_attribute_of_the_package() -> None:
    import megatron_lite.cli as cli
    from megatron_lite.cli.lightning_cli import CommandLineError, MegatronLiteCLI

    assert (cli.MegatronLiteCLI, cli.CommandLineError) == (MegatronLiteCLI, CommandLineError)
    with pytest.raises(AttributeError, match="has no attribute 'nope'"):
        cli.nope  # noqa: B018

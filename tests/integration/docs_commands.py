"""How the docs tests run a page's shell command in the test process, as a shell would (one interpreter for all):
``megatron-lite ARGS`` and ``python -m megatron_lite ARGS`` call the console script's own entry point,
``megatron_lite.cli.main(ARGS)``; ``python examples/X.py ARGS`` runs the script as ``__main__``.
A command that test_example_config_commands.py already runs (config_headers.py) is left to it.
"""

from __future__ import annotations

import runpy
import sys
import traceback

from config_headers import normalised, run_by_the_header_test


def cli_arguments(argv: list[str]) -> list[str] | None:
    """The arguments ``megatron_lite.cli.main`` gets for a ``megatron-lite`` command (None for another one)."""
    if argv[0] == "megatron-lite":
        return argv[1:]
    if argv[:3] == ["python", "-m", "megatron_lite"]:
        return argv[3:]
    return None


def run_elsewhere(argv: list[str]) -> str | None:
    """Why a shown command is not run by the docs tests: the config header whose command it is (the same
    arguments once the options that test sets itself are dropped), or None."""
    args = cli_arguments(argv)
    config = run_by_the_header_test().get(normalised(args)) if args else None
    return f"examples/configs/{config}'s header command, run by test_example_config_commands.py" if config else None


def run_one(argv: list[str]) -> int:
    """The exit status of one command, as a shell would see it (sys.argv is restored afterwards)."""
    saved_argv = sys.argv
    try:
        args = cli_arguments(argv)
        if args is not None:
            from megatron_lite.cli import main

            sys.argv = ["megatron-lite"]  # the arguments go to main, as the console script's sys.argv[1:] would
            main(args)
        elif argv[0] == "python" and len(argv) > 1 and argv[1].startswith("examples/"):
            sys.argv = argv[1:]
            runpy.run_path(argv[1], run_name="__main__")
        else:
            raise ValueError(f"not a megatron-lite or examples command: {argv}")
    except SystemExit as exit_:
        code = exit_.code
        return 0 if code is None else code if isinstance(code, int) else 1
    except Exception:  # noqa: BLE001 - a shell reports any failure as a status
        traceback.print_exc()
        return 1
    finally:
        sys.argv = saved_argv
    return 0

"""Runs the docs' shell commands one after the other in this one process (one interpreter start for all):

    python tests/integration/docs_commands.py PLAN.json RESULTS.json

PLAN.json is a list of ``{"argv": [...], "cwd": DIR, "log": FILE}``. ``megatron-lite ARGS`` and
``python -m megatron_lite ARGS`` call the console script's own entry point, ``megatron_lite.cli.main(ARGS)``;
``python examples/X.py ARGS`` runs the script as ``__main__``. Each command's stdout and stderr (its forked
ranks' too) go to its log; RESULTS.json gets each one's exit status (an exception is 1, its traceback logged)
and wall time in seconds.
"""
from __future__ import annotations

import json
import os
import runpy
import sys
import time
import traceback


def run_one(argv: list[str]) -> int:
    """The exit status of one command, as a shell would see it (sys.argv is restored afterwards)."""
    saved_argv = sys.argv
    try:
        if argv[0] == "megatron-lite" or argv[:3] == ["python", "-m", "megatron_lite"]:
            from megatron_lite.cli import main

            args = argv[1:] if argv[0] == "megatron-lite" else argv[3:]
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


def main(plan_path: str, results_path: str) -> None:
    plan = json.loads(open(plan_path).read())
    saved = os.dup(1), os.dup(2)
    results = []
    for item in plan:
        with open(item["log"], "wb") as log:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(log.fileno(), 1), os.dup2(log.fileno(), 2)
            os.chdir(item["cwd"])
            start = time.perf_counter()
            status = run_one(item["argv"])
            seconds = round(time.perf_counter() - start, 2)
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
        results.append({"status": status, "seconds": seconds})
        with open(results_path, "w") as f:  # written as it goes: a killed run still says how far it got
            json.dump(results, f)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])

"""What a fault test saw, as one JSON record per test, for ``docs/reliability.md``.

When ``MEGATRON_LITE_RELIABILITY_DIR`` is set, :func:`record` writes ``<dir>/<fault id>.json``;
``python docs/make_reliability.py <dir> docs/reliability.md`` renders the records as the table in docs/reliability.md.
Nothing is written otherwise, so the tests run the same with or without it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Optional

RELIABILITY_DIR_ENV = "MEGATRON_LITE_RELIABILITY_DIR"


def record(
    fault_id: str,
    fault: str,
    happened: str,
    steps_lost: Optional[int],
    data_lost: str,
    recover_s: Optional[float],
    **details,
) -> None:
    """One test's outcome: the fault, what happened, optimizer steps lost (None: not applicable), data
    lost, and seconds from the fault to a recovered (or cleanly ended) run."""
    directory = os.environ.get(RELIABILITY_DIR_ENV)
    if not directory:
        return
    Path(directory).mkdir(parents=True, exist_ok=True)
    entry = {
        "id": fault_id,
        "fault": fault,
        "happened": happened,
        "steps_lost": steps_lost,
        "data_lost": data_lost,
        "recover_s": None if recover_s is None else round(float(recover_s), 1),
        "recorded_at": time.strftime("%Y-%m-%d %H:%M:%S"),
        **details,
    }
    tmp = Path(directory) / f".{fault_id}.json.tmp"
    tmp.write_text(json.dumps(entry, indent=1, sort_keys=True))
    tmp.replace(Path(directory) / f"{fault_id}.json")

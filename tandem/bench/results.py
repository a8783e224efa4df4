"""Where benchmark results go: ``<out_dir>/<name>-<timestamp>.json``, written as indented JSON."""

from __future__ import annotations

import json
import os
import time


def result_path(out_dir: str, name: str) -> str:
    """A new result file's path under ``out_dir`` (created): ``name`` plus the local time."""
    os.makedirs(out_dir, exist_ok=True)
    return os.path.join(out_dir, f"{name}-{time.strftime('%Y%m%d-%H%M%S')}.json")


def write_json(result: dict, path: str) -> None:
    """Write ``result`` to ``path`` as indented JSON (again after each run, where a
    benchmark may be cut short)."""
    with open(path, "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)

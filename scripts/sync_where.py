"""Where the host synchronizes with the device outside the reader's one wait: turns torch's
sync debug mode to "warn" once CUDA is up, runs ``tandem.cli`` with the given arguments in
this process, and writes each distinct stack that synchronized to ``$OUT/syncs.txt``
(``DeviceReader.read_all`` exempts its own wait). Engine setup (graph capture, weights)
synchronizes too; what matters is a stack inside a step's launch.

Usage (on the GPU machine): OUT=DIR python3 scripts/sync_where.py bench decode --device cuda ...
"""

from __future__ import annotations

import os
import sys
import traceback
import warnings

import torch

from tandem.cli import main as cli_main


def main(argv: list[str]) -> int:
    seen: set[str] = set()
    with open(os.path.join(os.environ["OUT"], "syncs.txt"), "w") as out:

        def show(message, category, filename, lineno, file=None, line=None):
            stack = "".join(traceback.format_stack(limit=14)[:-1])
            if "synchroniz" in str(message) and stack not in seen:
                seen.add(stack)
                out.write(f"=== {message}\n{stack}\n")
                out.flush()

        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.init()
        torch.cuda.set_sync_debug_mode(1)
        code = cli_main(argv)
        out.write(f"{len(seen)} distinct stacks\n")
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

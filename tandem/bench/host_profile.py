"""Where the host's time goes: a run under Python's profiler (cProfile), as the functions
with the most time of their own and the most time including their callees. The profiler
slows every Python call, so the shares matter, not the absolute times."""

from __future__ import annotations

import cProfile
import pstats
from collections.abc import Callable


def profile_host(run: Callable[[], object], top: int = 30) -> dict:
    """Run ``run()`` under cProfile; the ``top`` functions by own time and by cumulative
    time (``file:line(name)``, calls, seconds), and the total profiled seconds."""
    profiler = cProfile.Profile()
    profiler.enable()
    try:
        run()
    finally:
        profiler.disable()
    stats = pstats.Stats(profiler)

    def ranked(key: int) -> list[dict]:
        rows = sorted(stats.stats.items(), key=lambda item: item[1][key], reverse=True)
        return [
            {
                "function": f"{path}:{line}({name})",
                "calls": calls[1],
                "own_s": calls[2],
                "cumulative_s": calls[3],
            }
            for (path, line, name), calls in rows[:top]
        ]

    return {"total_s": stats.total_tt, "by_own_time": ranked(2), "by_cumulative_time": ranked(3)}

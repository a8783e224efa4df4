"""What ``tandem bench serve`` makes of the client's records: each request's record, the
throughput and latency statistics (TTFT, TPOT, ITL, end-to-end) over a run, and the result's
text table, JSON file and PNG plot.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

_LATENCIES = ("ttft", "tpot", "itl", "e2e")


@dataclass
class RequestRecord:
    """What the client saw of one request; times are seconds (``send_s`` from the start)."""

    prompt_len: int
    output_len: int
    success: bool = False
    error: str = ""
    send_s: float = 0.0
    ttft: float | None = None
    e2e: float | None = None
    itl: list[float] = field(default_factory=list)
    output_tokens: int = 0
    prompt_tokens: int | None = None


def latency_stats(values: list[float]) -> dict[str, float]:
    """Mean, p50, p90 and p99 of latencies given in seconds, in milliseconds (0 if empty)."""
    if not values:
        return {"mean_ms": 0.0, "p50_ms": 0.0, "p90_ms": 0.0, "p99_ms": 0.0}
    ms = np.asarray(values, dtype=float) * 1000.0
    p50, p90, p99 = np.percentile(ms, [50, 90, 99])
    return {
        "mean_ms": float(ms.mean()),
        "p50_ms": float(p50),
        "p90_ms": float(p90),
        "p99_ms": float(p99),
    }


def tpot(record: RequestRecord) -> float | None:
    """Time per output token after the first: (e2e - ttft) / (n_out - 1); None if n_out < 2."""
    if record.ttft is None or record.e2e is None or record.output_tokens < 2:
        return None
    return (record.e2e - record.ttft) / (record.output_tokens - 1)


def compute_metrics(records: list[RequestRecord], duration_s: float) -> dict[str, Any]:
    """Throughput and latency statistics of finished requests over ``duration_s`` seconds."""
    ok = [r for r in records if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_len if r.prompt_tokens is None else r.prompt_tokens for r in ok)
    per = max(duration_s, 1e-9)
    samples = {
        "ttft": [r.ttft for r in ok if r.ttft is not None],
        "tpot": [t for t in map(tpot, ok) if t is not None],
        "itl": [gap for r in ok for gap in r.itl],
        "e2e": [r.e2e for r in ok if r.e2e is not None],
    }
    metrics: dict[str, Any] = {
        "successful_requests": len(ok),
        "failed_requests": len(records) - len(ok),
        "duration_s": duration_s,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / per,
        "output_throughput": out_tokens / per,
        "total_token_throughput": (in_tokens + out_tokens) / per,
    }
    metrics.update({name: latency_stats(samples[name]) for name in _LATENCIES})
    return metrics


def format_table(metrics: dict[str, Any]) -> str:
    """A plain-text table of the metrics."""
    labels = {
        "successful_requests": "Successful requests",
        "failed_requests": "Failed requests",
        "duration_s": "Duration (s)",
        "total_input_tokens": "Total input tokens",
        "total_output_tokens": "Total output tokens",
        "request_throughput": "Request throughput (req/s)",
        "output_throughput": "Output token throughput (tok/s)",
        "total_token_throughput": "Total token throughput (tok/s)",
    }
    rows = [
        (text, f"{metrics[key]:.2f}" if isinstance(metrics[key], float) else str(metrics[key]))
        for key, text in labels.items()
    ]
    rows += [
        (f"{stat.capitalize()} {name.upper()} (ms)", f"{metrics[name][f'{stat}_ms']:.2f}")
        for name in _LATENCIES
        for stat in ("mean", "p50", "p90", "p99")
    ]
    width = max(len(k) for k, _ in rows) + 2
    line = "=" * (width + 12)
    body = "\n".join(f"{k:<{width}}{v:>12}" for k, v in rows)
    return f"{line}\n{'Serving Benchmark Result':^{width + 12}}\n{line}\n{body}\n{line}"


def save_result(result: dict[str, Any], out_dir: str, label: str) -> str:
    """Write ``serve-<label>-<timestamp>.json`` and its ``.png`` plot; returns the JSON path."""
    os.makedirs(out_dir, exist_ok=True)
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", label)
    stem = os.path.join(out_dir, f"serve-{safe}-{time.strftime('%Y%m%d-%H%M%S')}")
    result["output_path"], result["plot_path"] = stem + ".json", stem + ".png"
    with open(result["output_path"], "w", encoding="utf-8") as f:
        json.dump(result, f, indent=2)
    plot_result(result, result["plot_path"])
    print(f"wrote {result['output_path']} and {result['plot_path']}")
    return result["output_path"]


def plot_result(result: dict[str, Any], path: str) -> None:
    """A PNG with TTFT and ITL histograms and the latency CDFs (matplotlib, Agg canvas)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    ok = [r for r in result["records"] if r["success"]]
    ttft = [r["ttft"] * 1000 for r in ok if r["ttft"] is not None]
    itl = [g * 1000 for r in ok for g in r["itl"]]
    e2e = [r["e2e"] * 1000 for r in ok if r["e2e"] is not None]
    m, cfg = result["metrics"], result["config"]
    fig = Figure(figsize=(13, 4))
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, 3)
    for ax, values, name in ((axes[0], ttft, "TTFT"), (axes[1], itl, "ITL")):
        if values:
            ax.hist(values, bins=min(50, max(10, len(values) // 2)), color="tab:blue")
        ax.set(title=f"{name} histogram", xlabel=f"{name} (ms)", ylabel="count")
    for values, name in ((ttft, "TTFT"), (itl, "ITL"), (e2e, "E2E")):
        if values:
            xs = np.sort(values)
            axes[2].plot(xs, np.arange(1, len(xs) + 1) / len(xs), label=name)
    axes[2].set(title="latency CDF", xlabel="ms", ylabel="fraction", xscale="log")
    axes[2].legend(loc="lower right")
    fig.suptitle(
        f"{cfg['model']} {cfg['endpoint']} {cfg['dataset']} rate={cfg['request_rate']} | "
        f"{m['successful_requests']} ok, {m['failed_requests']} failed | "
        f"{m['request_throughput']:.2f} req/s, {m['output_throughput']:.1f} out tok/s | "
        f"TTFT p50 {m['ttft']['p50_ms']:.1f} ms, ITL p50 {m['itl']['p50_ms']:.1f} ms"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=100)

"""Prometheus metrics of one server (its own registry, no global state)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServerMetrics:
    """Request outcomes, token counts, latency histograms and engine gauges."""

    def __init__(self, model_name: str):
        self.registry = CollectorRegistry()
        labels = ["model_name"]
        self.model_name = model_name
        r = self.registry
        self.requests = Counter(
            "tandem:request_success",
            "Finished requests by outcome",
            labels + ["finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "tandem:prompt_tokens", "Prompt tokens processed", labels, registry=r
        )
        self.generation_tokens = Counter(
            "tandem:generation_tokens", "Tokens generated", labels, registry=r
        )
        self.ttft = Histogram(
            "tandem:time_to_first_token_seconds",
            "Time to first token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.itl = Histogram(
            "tandem:inter_token_latency_seconds",
            "Time between output chunks per token",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.e2e = Histogram(
            "tandem:e2e_request_latency_seconds",
            "End-to-end request latency",
            labels,
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.running = Gauge("tandem:num_requests_running", "Requests running", labels, registry=r)
        self.waiting = Gauge("tandem:num_requests_waiting", "Requests waiting", labels, registry=r)
        self.kv_usage = Gauge(
            "tandem:kv_cache_usage_perc", "Fraction of KV blocks held", labels, registry=r
        )
        self.kv_free = Gauge(
            "tandem:num_free_kv_blocks", "KV blocks no request holds", labels, registry=r
        )
        self.kv_total = Gauge("tandem:num_kv_blocks", "KV blocks in all", labels, registry=r)
        # Speculative decoding, in vLLM's terms (totals mirrored from the engine core).
        self.spec = self._gauges(
            (
                ("spec_decode_num_drafts", "Draft runs verified"),
                ("spec_decode_num_draft_tokens", "Draft tokens proposed"),
                ("spec_decode_num_accepted_tokens", "Draft tokens accepted"),
            )
        )
        # The prefix cache (totals, in tokens): prompt tokens looked up and found cached.
        self.prefix = self._gauges(
            (
                ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
                ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
            )
        )
        # PD disaggregation (totals mirrored from the engine core of a prefill or decode
        # instance; absent on a mixed one).
        self.pd = self._gauges(
            (
                ("pd_kv_transfers", "KV handovers written (prefill instance)"),
                ("pd_kv_bytes", "KV bytes written (prefill instance)"),
                ("pd_kv_transfer_s", "Seconds spent writing KV (prefill instance)"),
                ("pd_handoffs", "Requests whose KV arrived (decode instance)"),
                ("pd_handoff_s_sum", "Seconds from transferring to KV ready, summed"),
                ("pd_failures", "Handovers that failed or timed out"),
            )
        )
        self.spec_per_pos = Gauge(
            "tandem:spec_decode_num_accepted_tokens_per_pos",
            "Accepted drafts by position",
            labels + ["position"],
            registry=r,
        )
        self.engine_up = Gauge(
            "tandem:engine_up",
            "1 while the engine core is live; 0 once it died or stalled (its gauges are then "
            "left out rather than shown stale)",
            labels,
            registry=r,
        )
        self.engine_gauges = (
            self.running,
            self.waiting,
            self.kv_usage,
            self.kv_free,
            self.kv_total,
            *self.spec.values(),
            *self.prefix.values(),
            *self.pd.values(),
            self.spec_per_pos,
        )

    def _gauges(self, names: tuple[tuple[str, str], ...]) -> dict[str, Gauge]:
        """One ``tandem:<key>`` gauge per (key, help), labelled by model name."""
        return {
            key: Gauge(f"tandem:{key}", help_text, ["model_name"], registry=self.registry)
            for key, help_text in names
        }

    def record_finish(self, reason: str, num_prompt: int, num_generated: int) -> None:
        self.requests.labels(self.model_name, reason).inc()
        self.prompt_tokens.labels(self.model_name).inc(num_prompt)
        self.generation_tokens.labels(self.model_name).inc(num_generated)

    def render(self, stats: dict, engine_live: bool = True) -> bytes:
        """Refresh the engine gauges from the core's latest stats and render the registry.
        With the engine not live, its gauges are removed: a scrape never shows them stale."""
        name = self.model_name
        self.engine_up.labels(name).set(1 if engine_live else 0)
        if not engine_live:
            for gauge in self.engine_gauges:
                gauge.clear()
        elif stats:
            self.running.labels(name).set(stats.get("num_running", 0))
            self.waiting.labels(name).set(stats.get("num_waiting", 0))
            self.kv_usage.labels(name).set(stats.get("kv_cache_usage", 0.0))
            self.kv_free.labels(name).set(stats.get("num_free_kv_blocks", 0))
            self.kv_total.labels(name).set(stats.get("num_kv_blocks", 0))
            for key, gauge in (*self.spec.items(), *self.prefix.items()):
                gauge.labels(name).set(stats.get(key, 0))
            for key, gauge in self.pd.items():
                if key in stats:
                    gauge.labels(name).set(stats[key])
            per_pos = stats.get("spec_decode_num_accepted_tokens_per_pos", [])
            for position, count in enumerate(per_pos):
                self.spec_per_pos.labels(name, str(position)).set(count)
        return generate_latest(self.registry)

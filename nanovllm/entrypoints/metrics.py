"""Prometheus metrics, named as vLLM names them with a `nanovllm:` prefix. Each server has its
own registry (several servers can live in one process). Engine state (requests running and
waiting, KV cache, prefix-cache hits, preemptions) is read from the engine's latest stats when
scraped; token counts and latencies are recorded as tokens arrive from the engine."""
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

TTFT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
E2E_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 60.0, 120.0, 300.0)


class _EngineCollector:
    def __init__(self, stats, labels: dict):
        self.stats, self.labels = stats, labels

    def collect(self):
        stats, names, values = self.stats(), list(self.labels), list(self.labels.values())
        total = stats.get("kv_blocks_total") or 1
        for name, doc, value in (
                ("num_requests_running", "Requests in the engine's running batch.", stats.get("num_running", 0)),
                ("num_requests_waiting", "Requests queued in the engine.", stats.get("num_waiting", 0)),
                ("kv_cache_usage_perc", "Fraction of KV-cache blocks in use (1 = 100%).",
                 stats.get("kv_blocks_used", 0) / total)):
            gauge = GaugeMetricFamily(f"nanovllm:{name}", doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge
        for name, doc, key in (("prefix_cache_hit_blocks", "KV-cache blocks found in the prefix cache.",
                                "prefix_cache_hit_blocks"),
                               ("num_preemptions", "Sequences preempted for lack of KV-cache blocks.",
                                "num_preemptions")):
            counter = CounterMetricFamily(f"nanovllm:{name}", doc, labels=names)
            counter.add_metric(values, stats.get(key, 0))
            yield counter
        if "spec_decode_num_drafts" in stats:
            yield from self._speculative(stats, names, values)

    @staticmethod
    def _speculative(stats: dict, names: list, values: list):
        """Speculative decoding's counters; the rates from them, so they hold for the sum of
        data-parallel replicas too."""
        drafts, proposed, accepted = (stats[f"spec_decode_num_{key}"] for key in ("drafts", "draft_tokens",
                                                                               "accepted_tokens"))
        for key, doc, value in (("drafts", "Steps of a sequence that verified proposals.", drafts),
                                ("draft_tokens", "Proposed tokens verified.", proposed),
                                ("accepted_tokens", "Proposed tokens accepted.", accepted)):
            counter = CounterMetricFamily(f"nanovllm:spec_decode_num_{key}", doc, labels=names)
            counter.add_metric(values, value)
            yield counter
        for key, doc, value in (
                ("acceptance_rate", "Accepted over proposed tokens, since start.", accepted / max(proposed, 1)),
                ("mean_accepted_length", "Tokens a verifying sequence gains a step (accepted + 1), since start.",
                 1 + accepted / max(drafts, 1))):
            gauge = GaugeMetricFamily(f"nanovllm:spec_decode_{key}", doc, labels=names)
            gauge.add_metric(values, value)
            yield gauge


class ServerMetrics:
    """`stats()` returns the engine's latest stats (AsyncEngine.stats)."""

    def __init__(self, model_name: str, stats):
        self.registry = CollectorRegistry()
        labels = {"model_name": model_name}
        self.registry.register(_EngineCollector(stats, labels))

        def metric(cls, name, doc, **more):
            return cls(f"nanovllm:{name}", doc, list(labels), registry=self.registry, **more).labels(**labels)

        self._prompt_tokens = metric(Counter, "prompt_tokens", "Prompt tokens of accepted requests.")
        self._generation_tokens = metric(Counter, "generation_tokens", "Tokens generated.")
        self._ttft = metric(Histogram, "time_to_first_token_seconds", "Time from arrival to the first token.",
                            buckets=TTFT_BUCKETS)
        self._itl = metric(Histogram, "inter_token_latency_seconds", "Time between two tokens of a request.",
                           buckets=ITL_BUCKETS)
        self._e2e = metric(Histogram, "e2e_request_latency_seconds", "Time from arrival to the last token.",
                           buckets=E2E_BUCKETS)
        self._finished = Counter("nanovllm:request_success", "Requests finished, by finish reason.",
                                 [*labels, "finished_reason"], registry=self.registry)
        self._labels = labels

    def prompt_tokens(self, n: int) -> None:
        self._prompt_tokens.inc(n)

    def generation_tokens(self, n: int) -> None:
        self._generation_tokens.inc(n)

    def first_token(self, seconds: float) -> None:
        self._ttft.observe(seconds)

    def inter_token(self, seconds: float) -> None:
        self._itl.observe(seconds)

    def finished(self, reason: str, seconds: float) -> None:
        """One engine request done: stop, length, abort (its client left) or error (the engine failed)."""
        self._finished.labels(**self._labels, finished_reason=reason).inc()
        if reason in ("stop", "length"):
            self._e2e.observe(seconds)

    def render(self) -> bytes:
        return generate_latest(self.registry)

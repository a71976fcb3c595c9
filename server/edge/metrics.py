"""Prometheus metrics of one server instance, served at /metrics.

Owns a `CollectorRegistry` per app (several servers can share a process, as the tests
do), the metric objects in it, and the translation of engine `StepStats` into them. The
engine thread reports after every step and once when it goes idle; HTTP middleware
reports error statuses. A scrape only renders what those reports said: this module must
never read requests or engine state to answer one.

Names carry the `llamaserve:` prefix and mean what vLLM's `vllm:` metrics of the same
name mean, so dashboards and alerts written for one read the other. Every series is
labelled with `model_name`, the first served model name.
"""

from __future__ import annotations

import prometheus_client
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    GCCollector,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from scheduler import StepStats

PREFIX = "llamaserve:"
CONTENT_TYPE = CONTENT_TYPE_LATEST

# One ladder for every latency: 1 ms (a decode step of a small model on a GPU) to ten
# minutes (a long request on a loaded CPU), about three buckets per decade.
LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0,
)  # fmt: skip

FINISH_REASONS = ("stop", "length", "abort")
STATUS_CLASSES = ("4xx", "5xx")

# A `_created` sample per counter and histogram doubles the series for no dashboard use;
# vLLM turns them off for the same reason.
prometheus_client.disable_created_metrics()


def token_buckets(limit: int) -> list[float]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (included), as vLLM sizes token histograms."""
    buckets: list[float] = []
    scale = 1
    while True:
        for mantissa in (1, 2, 5):
            value = mantissa * scale
            if value >= limit:
                return [*buckets, float(limit)]
            buckets.append(float(value))
        scale *= 10


class _RunningTotal:
    """Feeds a counter from a total kept elsewhere (the KV manager's prefix-cache
    counts), adding only what grew since the last report."""

    def __init__(self, counter: Counter) -> None:
        self.counter = counter
        self.last = 0

    def update(self, total: int) -> None:
        if total > self.last:
            self.counter.inc(total - self.last)
        # A smaller total means the source started over; count from there, never back.
        self.last = total


class ServerMetrics:
    """The metrics of one server; `observe_step` is called on the engine thread,
    `count_response` on the event loop (prometheus-client objects are thread-safe)."""

    def __init__(self, model_name: str, max_model_len: int, max_num_batched_tokens: int) -> None:
        self.model_name = model_name
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        PlatformCollector(registry=self.registry)
        GCCollector(registry=self.registry)
        # Registered in this order, which is the order a scrape lists them in.
        self._add_scheduler_gauges()
        self._add_token_counters()
        self._add_request_counters()
        self._add_latency_histograms()
        self._add_request_token_histograms(max_model_len)
        self._add_spec_decode_counters()
        self._add_lora_metrics()
        self.iteration_tokens = self._histogram(
            "iteration_tokens_total",
            "Tokens fed to the model in one engine step (prefill chunks plus decodes).",
            token_buckets(max_num_batched_tokens),
        )

    def _gauge(self, name: str, doc: str) -> Gauge:
        return Gauge(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(
            self.model_name
        )

    def _counter(self, name: str, doc: str) -> Counter:
        return Counter(PREFIX + name, doc, ["model_name"], registry=self.registry).labels(
            self.model_name
        )

    def _histogram(
        self, name: str, doc: str, buckets: list[float] | tuple[float, ...]
    ) -> Histogram:
        return Histogram(
            PREFIX + name, doc, ["model_name"], buckets=buckets, registry=self.registry
        ).labels(self.model_name)

    def _add_scheduler_gauges(self) -> None:
        gauge = self._gauge
        self.num_requests_running = gauge(
            "num_requests_running", "Sequences in the running batch (decoding or prefilling)."
        )
        self.num_requests_waiting = gauge(
            "num_requests_waiting", "Sequences waiting to be scheduled, preempted ones included."
        )
        self.kv_cache_usage_perc = gauge(
            "kv_cache_usage_perc",
            "Share of KV-cache blocks held by requests, 0 to 1 (cached free blocks count free).",
        )
        self.kv_cache_blocks_total = gauge(
            "kv_cache_blocks_total", "KV-cache blocks the memory budget allows."
        )

    def _add_token_counters(self) -> None:
        counter = self._counter
        self.prompt_tokens = counter(
            "prompt_tokens", "Prompt tokens of requests that got their first token."
        )
        self.generation_tokens = counter("generation_tokens", "Tokens generated.")
        self.num_preemptions = counter(
            "num_preemptions", "Preemptions: running requests whose KV blocks were taken back."
        )
        self.prefix_cache_queries = _RunningTotal(
            counter("prefix_cache_queries", "Prompt tokens looked up in the prefix cache.")
        )
        self.prefix_cache_hits = _RunningTotal(
            counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.")
        )

    def _add_request_counters(self) -> None:
        reg, model_name = self.registry, self.model_name
        self.request_success = Counter(
            PREFIX + "request_success",
            "Finished requests, by why they finished (stop, length, abort).",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.request_errors = Counter(
            PREFIX + "request_errors",
            "HTTP responses with an error status, by status class (4xx, 5xx).",
            ["model_name", "status_class"],
            registry=reg,
        )
        # Known label values exist from the start at 0, so rate() has a series to work on
        # before the first event, and an error rate reads 0 rather than "no data".
        for reason in FINISH_REASONS:
            self.request_success.labels(model_name, reason)
        for status_class in STATUS_CLASSES:
            self.request_errors.labels(model_name, status_class)

    def _add_lora_metrics(self) -> None:
        """Per LoRA adapter (label `lora_name`), counted when its requests finish."""
        labels = ["model_name", "lora_name"]
        self.lora_requests = Counter(
            PREFIX + "lora_requests",
            "Finished requests that ran with a LoRA adapter, by adapter.",
            labels,
            registry=self.registry,
        )
        self.lora_prompt_tokens = Counter(
            PREFIX + "lora_prompt_tokens",
            "Prompt tokens of finished requests, by LoRA adapter.",
            labels,
            registry=self.registry,
        )
        self.lora_generation_tokens = Counter(
            PREFIX + "lora_generation_tokens",
            "Generated tokens of finished requests, by LoRA adapter.",
            labels,
            registry=self.registry,
        )
        self.lora_resident = self._gauge("lora_adapters_resident", "LoRA adapters in memory.")

    def _add_latency_histograms(self) -> None:
        histogram = self._histogram
        self.time_to_first_token = histogram(
            "time_to_first_token_seconds",
            "Seconds from arrival to the first generated token.",
            LATENCY_BUCKETS_S,
        )
        self.inter_token_latency = histogram(
            "inter_token_latency_seconds",
            "Seconds between consecutive tokens of one sequence.",
            LATENCY_BUCKETS_S,
        )
        self.e2e_request_latency = histogram(
            "e2e_request_latency_seconds",
            "Seconds from arrival to finish, aborted requests included.",
            LATENCY_BUCKETS_S,
        )
        self.request_queue_time = histogram(
            "request_queue_time_seconds",
            "Seconds from arrival to first being scheduled.",
            LATENCY_BUCKETS_S,
        )

    def _add_request_token_histograms(self, max_model_len: int) -> None:
        histogram = self._histogram
        request_tokens = token_buckets(max_model_len)
        self.request_prompt_tokens = histogram(
            "request_prompt_tokens", "Prompt tokens of each finished request.", request_tokens
        )
        self.request_generation_tokens = histogram(
            "request_generation_tokens",
            "Generated tokens of each finished request.",
            request_tokens,
        )

    def _add_spec_decode_counters(self) -> None:
        counter, reg = self._counter, self.registry
        # Speculative decoding, as vLLM's spec_decode counters (scheduler/spec/speculation.py).
        self.spec_num_drafts = counter(
            "spec_decode_num_drafts", "Sequences that offered guessed tokens to a step."
        )
        self.spec_num_draft_tokens = counter(
            "spec_decode_num_draft_tokens", "Guessed tokens verified."
        )
        self.spec_num_accepted_tokens = counter(
            "spec_decode_num_accepted_tokens", "Guessed tokens the model would have chosen."
        )
        self.spec_accepted_per_position = Counter(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Guessed tokens accepted, by their position in the guess (0: the first).",
            ["model_name", "position"],
            registry=reg,
        )

    def observe_step(self, stats: StepStats) -> None:
        self.num_requests_running.set(stats.num_running)
        self.num_requests_waiting.set(stats.num_waiting)
        self.kv_cache_usage_perc.set(stats.kv_usage)
        self.kv_cache_blocks_total.set(stats.kv_blocks_total)
        self.prompt_tokens.inc(stats.num_prompt_tokens)
        self.generation_tokens.inc(stats.num_generated)
        self.num_preemptions.inc(stats.num_preemptions)
        self.prefix_cache_queries.update(stats.prefix_cache_queries)
        self.prefix_cache_hits.update(stats.prefix_cache_hits)
        if stats.num_tokens:  # idle reports and empty steps are not iterations
            self.iteration_tokens.observe(stats.num_tokens)
        for ttft_s in stats.ttft_s:
            self.time_to_first_token.observe(ttft_s)
        for gap_s in stats.inter_token_s:
            self.inter_token_latency.observe(gap_s)
        if stats.spec is not None:
            spec = stats.spec
            self.spec_num_drafts.inc(spec.num_drafts)
            self.spec_num_draft_tokens.inc(spec.num_draft_tokens)
            self.spec_num_accepted_tokens.inc(spec.num_accepted_tokens)
            for position, count in enumerate(spec.accepted_per_position):
                self.spec_accepted_per_position.labels(self.model_name, str(position)).inc(count)
        self.lora_resident.set(stats.num_loras_resident)
        for done in stats.finished:
            if done.lora_name is not None:
                self.lora_requests.labels(self.model_name, done.lora_name).inc()
                self.lora_prompt_tokens.labels(self.model_name, done.lora_name).inc(
                    done.num_prompt_tokens
                )
                self.lora_generation_tokens.labels(self.model_name, done.lora_name).inc(
                    done.num_output_tokens
                )
            self.request_success.labels(self.model_name, done.finish_reason).inc()
            self.e2e_request_latency.observe(done.e2e_s)
            self.request_queue_time.observe(done.queue_s)
            self.request_prompt_tokens.observe(done.num_prompt_tokens)
            self.request_generation_tokens.observe(done.num_output_tokens)

    def count_response(self, status: int) -> None:
        if status >= 400:
            self.request_errors.labels(self.model_name, f"{status // 100}xx").inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)

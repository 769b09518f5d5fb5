"""``GET /metrics``: the server's operational signals in the Prometheus text format.

Per model id (the served document): requests by HTTP status, prompt and generated tokens, requests
waiting and decoding, time to first token and request latency (histograms). Plus the modules
loaded, their bytes and the loads so far. Requests for a model id the server does not serve are
counted under ``model="unknown"`` (a client must not be able to create label values), and those
refused before their body is read (401, 413) under ``model=""``.

One ``CollectorRegistry`` per app, so several apps in one process (tests) do not share counters.
"""
from __future__ import annotations

from collections import Counter as Tally

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily

from .job import Job

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
# seconds: a token on a CPU is ~10-100 ms, a long answer on a busy server tens of seconds
TTFT_BUCKETS = (0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)
LATENCY_BUCKETS = (0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)


class _Live:
    """Gauges read at scrape time: the scheduler's queue and batch by model, the module registry."""

    def __init__(self, scheduler, registry):
        self.scheduler, self.registry = scheduler, registry

    def collect(self):
        waiting, running = self.scheduler.snapshot()
        for name, jobs, doc in (("nectar_queue_depth", waiting, "Requests waiting for a batch row."),
                                ("nectar_running_requests", running, "Requests decoding in the running batch.")):
            g = GaugeMetricFamily(name, doc, labels=["model"])
            counts = Tally(j.model for j in jobs)
            for model in self.registry.names:
                g.add_metric([model], counts.get(model, 0))
            yield g
        g = GaugeMetricFamily("nectar_batch_size", "Rows in the running batch, all models.")
        g.add_metric([], len(running))
        yield g
        loaded = self.registry.loaded
        g = GaugeMetricFamily("nectar_module_loaded", "1 when the model's module is in memory.", labels=["model"])
        for model in self.registry.names:
            g.add_metric([model], 1 if model in loaded else 0)
        yield g
        g = GaugeMetricFamily("nectar_module_bytes_loaded", "Bytes of the modules in memory (a quantized module: its codes and the floats kept from them).")
        g.add_metric([], self.registry.loaded_bytes)
        yield g
        g = GaugeMetricFamily("nectar_module_loads", "Module loads since start (evicted and asked again: loaded again).")
        g.add_metric([], self.registry.loads)
        yield g


class ServeMetrics:
    def __init__(self, scheduler, registry):
        self.names = set(registry.names)
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("nectar_requests", "Chat completion requests by HTTP status.", ["model", "status"],
                                registry=r)
        self.prompt_tokens = Counter("nectar_prompt_tokens", "Prompt (query) tokens of requests that ran.",
                                     ["model"], registry=r)
        self.generated_tokens = Counter("nectar_generation_tokens", "Tokens generated.", ["model"], registry=r)
        self.ttft = Histogram("nectar_time_to_first_token_seconds", "From arrival to the first generated token.",
                              ["model"], buckets=TTFT_BUCKETS, registry=r)
        self.latency = Histogram("nectar_request_latency_seconds", "From arrival to the last token.",
                                 ["model"], buckets=LATENCY_BUCKETS, registry=r)
        r.register(_Live(scheduler, registry))

    def label(self, model: str | None) -> str:
        if model is None:
            return ""
        if model not in self.names and "+" in model and all(p in self.names for p in model.split("+")):
            return "composite"  # "a+b": one label for every composition (clients must not create labels)
        return model if model in self.names else "unknown"

    def refused(self, model: str | None, status: int) -> None:
        self.requests.labels(self.label(model), str(status)).inc()

    def ran(self, job: Job, status: int) -> None:
        """A request that reached the engine, at its end (answered, failed or abandoned)."""
        model = self.label(job.model)
        self.requests.labels(model, str(status)).inc()
        self.prompt_tokens.labels(model).inc(len(job.prompt_ids))
        self.generated_tokens.labels(model).inc(job.completion_tokens)
        if job.first_token_at is not None:
            self.ttft.labels(model).observe(job.first_token_at - job.submitted_at)
        if job.finished_at is not None and status == 200:
            self.latency.labels(model).observe(job.finished_at - job.submitted_at)

    def text(self) -> bytes:
        return generate_latest(self.registry)

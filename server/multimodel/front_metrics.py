"""/metrics of a several-model server: its own gauges of which models are loaded and the
memory each one's process holds, then every loaded model's own `llamaserve:` metrics, read
from its process at scrape time and merged family by family (each series already carries
its model's `model_name`), so Prometheus scrapes one address.

The gauges are read at scrape time, from the pool and the kernel: nothing here counts
anything itself.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterable, Iterator

import httpx
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from server.multimodel.child import ModelProcess
from server.multimodel.memory import rss_bytes
from server.multimodel.pool import ModelPool

PREFIX = "llamaserve:"


class _PoolCollector(Collector):
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool

    def collect(self) -> Iterator[Metric]:
        entries = list(self.pool.entries.values())
        count = GaugeMetricFamily(PREFIX + "models_loaded", "Models whose process is serving.")
        count.add_metric([], sum(e.status == "loaded" for e in entries))
        loaded = GaugeMetricFamily(
            PREFIX + "model_loaded", "1 while the model is loaded, else 0.", labels=["model_name"]
        )
        memory = GaugeMetricFamily(
            PREFIX + "model_memory_bytes",
            "Resident memory of the model's process (0 when unloaded).",
            labels=["model_name"],
        )
        estimate = GaugeMetricFamily(
            PREFIX + "model_memory_estimate_bytes",
            "What the model is counted as needing before it loads.",
            labels=["model_name"],
        )
        loads = CounterMetricFamily(
            PREFIX + "model_loads", "Times the model was loaded.", labels=["model_name"]
        )
        for e in entries:
            name = [e.spec.name]
            process = e.process
            loaded.add_metric(name, float(e.status == "loaded"))
            memory.add_metric(name, rss_bytes(process.pid) if process is not None else 0)
            estimate.add_metric(name, e.estimate_bytes)
            loads.add_metric(name, e.loads)
        yield from (count, loaded, memory, estimate, loads)


class _Families(Collector):
    def __init__(self, families: Iterable[Metric]) -> None:
        self.families = list(families)

    def collect(self) -> Iterator[Metric]:
        yield from self.families


def merge_families(texts: Iterable[str]) -> list[Metric]:
    """The `llamaserve:` families of several scrapes, one family per name."""
    merged: dict[str, Metric] = {}
    for text in texts:
        for family in text_string_to_metric_families(text):
            if not family.name.startswith(PREFIX):
                continue
            if family.name in merged:
                merged[family.name].samples.extend(family.samples)
            else:
                merged[family.name] = family
    return list(merged.values())


class FrontMetrics:
    def __init__(self, pool: ModelPool) -> None:
        self.pool = pool
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)
        self.registry.register(_PoolCollector(pool))

    async def render(self, client: httpx.AsyncClient) -> bytes:
        processes = [e.process for e in self.pool.entries.values() if e.process is not None]

        async def scrape(process: ModelProcess) -> str:
            try:
                response = await client.get(
                    f"{process.base_url}/metrics",
                    headers={"authorization": f"Bearer {process.key}"},
                    timeout=5.0,
                )
                return response.text if response.status_code == 200 else ""
            except httpx.HTTPError:
                return ""  # a process going away mid-scrape: its series are left out

        texts = await asyncio.gather(*(scrape(p) for p in processes))
        registry = CollectorRegistry()
        registry.register(_Families(merge_families(texts)))
        return generate_latest(self.registry) + generate_latest(registry)

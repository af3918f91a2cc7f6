"""Prometheus metrics of one gateway app, kept in its own registry so several apps can coexist.

Several gateway processes behind one port (`serve --gateways N`) share their counters and
histograms through prometheus_client's multiprocess mode (PROMETHEUS_MULTIPROC_DIR, set by the
launcher): any of them answers /metrics with the sums over all of them, including gateways that
have exited. The scheduler's gauges are read live from this process's backend.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Histogram,
    generate_latest,
    multiprocess,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from shared.protocol import SchedulerStats

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160, 320)
_TPOT_BUCKETS = (0.005, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5, 1, 2.5)


class _SchedulerCollector:
    """Reads the backend's latest SchedulerStats at scrape time, so gauges are never stale."""

    def __init__(self, stats: Callable[[], SchedulerStats | None]) -> None:
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        s = self._stats()
        gauges = [
            ("num_requests_running", "Sequences running on the executor", s and s.num_running),
            ("num_requests_waiting", "Requests waiting for admission", s and s.num_waiting),
            ("num_requests_swapped", "Requests preempted to CPU memory", s and s.num_swapped),
            ("kv_blocks_used", "Device KV cache blocks in use", s and s.kv_blocks_used),
            ("kv_blocks_total", "Device KV cache blocks in the pool", s and s.kv_blocks_total),
        ]
        for name, doc, value in gauges:
            yield GaugeMetricFamily(f"pagedserve_{name}", doc, value=value or 0)
        ratio = s.kv_blocks_used / s.kv_blocks_total if s and s.kv_blocks_total else 0.0
        yield GaugeMetricFamily(
            "pagedserve_kv_cache_usage_ratio", "Fraction of device KV blocks in use", value=ratio
        )
        for suffix, doc, values in (
            ("", "after the last step", s.kv_fractions if s else {}),
            ("_avg", "averaged over time since start", s.kv_fractions_avg if s else {}),
        ):
            family = GaugeMetricFamily(
                f"pagedserve_kv_memory_fraction{suffix}",
                f"Fraction of device KV slots by what they hold, {doc}",
                labels=["kind"],
            )
            for kind, value in values.items():
                family.add_metric([kind], value)
            yield family
        yield CounterMetricFamily(
            "pagedserve_num_preemptions",
            "Preemptions since the scheduler started",
            value=s.num_preemptions if s else 0,
        )
        yield CounterMetricFamily(
            "pagedserve_prefix_cache_queried_tokens",
            "Tokens of admitted sequences looked up in the prefix cache",
            value=s.prefix_cache_queried_tokens if s else 0,
        )
        yield CounterMetricFamily(
            "pagedserve_prefix_cache_hit_tokens",
            "Tokens of admitted sequences whose K/V the prefix cache already held",
            value=s.prefix_cache_hit_tokens if s else 0,
        )
        yield GaugeMetricFamily(
            "pagedserve_prefix_cache_blocks",
            "Device KV blocks the prefix cache can hand out (in use or free)",
            value=s.prefix_cache_blocks if s else 0,
        )
        # Speculative decoding, labelled by method (none while it is off).
        proposed = CounterMetricFamily(
            "pagedserve_spec_decode_proposed_tokens",
            "Speculative tokens proposed and verified since the scheduler started",
            labels=["method"],
        )
        accepted = CounterMetricFamily(
            "pagedserve_spec_decode_accepted_tokens",
            "Speculative tokens accepted by verification since the scheduler started",
            labels=["method"],
        )
        rate = GaugeMetricFamily(
            "pagedserve_spec_decode_acceptance_rate",
            "Accepted over proposed speculative tokens since the scheduler started",
            labels=["method"],
        )
        if s and s.spec_method:
            proposed.add_metric([s.spec_method], s.spec_proposed_tokens)
            accepted.add_metric([s.spec_method], s.spec_accepted_tokens)
            share = s.spec_accepted_tokens / s.spec_proposed_tokens if s.spec_proposed_tokens else 0
            rate.add_metric([s.spec_method], share)
        yield from (proposed, accepted, rate)
        yield CounterMetricFamily(
            "pagedserve_executor_restarts",
            "Dead executors replaced (their requests recomputed) since the scheduler started",
            value=s.num_executor_restarts if s else 0,
        )
        yield GaugeMetricFamily(
            "pagedserve_executor_restarting",
            "1 while a dead executor is being replaced",
            value=1 if s and s.executor_restarting else 0,
        )


class _ReplicaCollector:
    """Per-replica gauges, labelled replica="i", when the gateway fronts several stacks."""

    def __init__(self, table: Callable[[], list[tuple[bool, int, int, Any]]]) -> None:
        self._table = table

    def collect(self) -> Iterator[Metric]:
        rows = self._table()
        families = {
            "up": GaugeMetricFamily(
                "pagedserve_replica_up", "1 while the replica is ready", labels=["replica"]
            ),
            "owed": GaugeMetricFamily(
                "pagedserve_replica_outstanding_tokens",
                "Prompt plus max output tokens of the replica's unfinished requests",
                labels=["replica"],
            ),
            "running": GaugeMetricFamily(
                "pagedserve_replica_num_requests_running",
                "Sequences running on the replica's executor",
                labels=["replica"],
            ),
            "kv": GaugeMetricFamily(
                "pagedserve_replica_kv_cache_usage_ratio",
                "Fraction of the replica's device KV blocks in use",
                labels=["replica"],
            ),
        }
        for i, (ready, _routed, owed, s) in enumerate(rows):  # routed: a real Counter
            label = [str(i)]
            families["up"].add_metric(label, 1.0 if ready else 0.0)
            families["owed"].add_metric(label, owed)
            families["running"].add_metric(label, s.num_running if s else 0)
            ratio = s.kv_blocks_used / s.kv_blocks_total if s and s.kv_blocks_total else 0.0
            families["kv"].add_metric(label, ratio)
        yield from families.values()


class GatewayMetrics:
    def __init__(
        self,
        stats: Callable[[], SchedulerStats | None],
        replicas: Callable[[], list[tuple[bool, int, int, Any]]] | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self._live: list[Any] = [_SchedulerCollector(stats)]
        if replicas is not None:
            self._live.append(_ReplicaCollector(replicas))
        for collector in self._live:
            self.registry.register(collector)
        if replicas is not None:
            # A real counter, counted as requests are routed (ReplicaRouter.on_route): with
            # several gateway processes the multiprocess files sum every process's routing.
            self.replica_requests = Counter(
                "pagedserve_replica_requests",
                "Requests routed to the replica",
                ["replica"],
                registry=self.registry,
            )
        self.prompt_tokens = Counter(
            "pagedserve_prompt_tokens", "Prompt tokens of accepted requests", registry=self.registry
        )
        self.generation_tokens = Counter(
            "pagedserve_generation_tokens", "Tokens generated", registry=self.registry
        )
        self.requests_finished = Counter(
            "pagedserve_requests_finished",
            "Requests ended, by finish reason (of the first sample; abort: client went away)",
            ["finish_reason"],
            registry=self.registry,
        )
        self.time_to_first_token = Histogram(
            "pagedserve_time_to_first_token_seconds",
            "Arrival to first generated token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.time_per_output_token = Histogram(
            "pagedserve_time_per_output_token_seconds",
            "Mean time between output tokens after the first, per request",
            buckets=_TPOT_BUCKETS,
            registry=self.registry,
        )
        self.e2e_latency = Histogram(
            "pagedserve_e2e_request_latency_seconds",
            "Arrival to last token",
            buckets=_LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.connections_refused = Counter(
            "pagedserve_connections_refused",
            "Connections answered 503 and closed at once: the gateway process had "
            "--max-connections open",
            registry=self.registry,
        )

    def add_live(self, collector: Any) -> None:
        """A collector read at scrape time, as the scheduler's gauges are."""
        self._live.append(collector)
        self.registry.register(collector)

    def render(self) -> tuple[bytes, str]:
        """The exposition body and its content type."""
        directory = os.environ.get("PROMETHEUS_MULTIPROC_DIR")
        if not directory:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
        # Every gateway process's counters from their files, not only this one's.
        registry = CollectorRegistry()
        multiprocess.MultiProcessCollector(registry, path=directory)
        for collector in self._live:
            registry.register(collector)
        return generate_latest(registry), CONTENT_TYPE_LATEST

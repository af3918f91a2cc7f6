"""/metrics series of replicas placed by a Ray cluster (`serve --ray-address`): how many times
each was placed again after losing its ranks, read at scrape time from the launcher's file."""

from __future__ import annotations

import json
from collections.abc import Iterator

from prometheus_client.core import CounterMetricFamily, Metric


class PlacementCollector:
    def __init__(self, path: str) -> None:
        self.path = path  # {"<replica>": {"replacements": n, "nodes": [node id per rank]}}

    def collect(self) -> Iterator[Metric]:
        try:
            with open(self.path) as f:
                replicas = json.load(f)
        except (FileNotFoundError, json.JSONDecodeError):
            replicas = {}  # not written yet: no series rather than a failed scrape
        family = CounterMetricFamily(
            "pagedserve_replica_replacements",
            "Times the replica was placed again on the Ray cluster after losing a rank or node",
            labels=["replica"],
        )
        for index, placement in sorted(replicas.items()):
            family.add_metric([index], placement["replacements"])
        yield family

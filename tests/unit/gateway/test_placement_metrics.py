"""/metrics counts each replica's re-placements on a Ray cluster, read from the launcher's file."""

from __future__ import annotations

import json

from services.gateway.metrics import GatewayMetrics
from services.gateway.placement_metrics import PlacementCollector


def test_re_placements_are_counted_per_replica_as_the_file_says_at_each_scrape(tmp_path):
    path = tmp_path / "placement.json"
    metrics = GatewayMetrics(lambda: None)
    metrics.add_live(PlacementCollector(str(path)))
    assert b"pagedserve_replica_replacements_total{" not in metrics.render()[0]  # no file yet
    path.write_text(json.dumps({"0": {"replacements": 0, "nodes": ["a"]},
                                "1": {"replacements": 2, "nodes": ["b", "c"]}}))  # fmt: skip
    body = metrics.render()[0].decode()
    assert 'pagedserve_replica_replacements_total{replica="0"} 0.0' in body
    assert 'pagedserve_replica_replacements_total{replica="1"} 2.0' in body
    path.write_text(json.dumps({"0": {"replacements": 1, "nodes": ["d"]}}))
    assert 'pagedserve_replica_replacements_total{replica="0"} 1.0' in metrics.render()[0].decode()

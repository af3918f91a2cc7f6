"""The Grafana dashboard queries only metrics the gateway exports, through the provisioned
Prometheus data source, and the monitoring profile mounts files that exist."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client.parser import text_string_to_metric_families

from tests.deploy.compose_file import load_services
from tests.support.gateway_fakes import CHAT

DOCKER = Path(__file__).resolve().parents[2] / "docker"
DASHBOARD = DOCKER / "grafana" / "dashboards" / "pagedserve.json"
METRIC = re.compile(r"\bpagedserve_[a-z0-9_]+")


def _panels() -> list[dict]:
    return json.loads(DASHBOARD.read_text())["panels"]


def _queried_metrics() -> set[str]:
    return {m for p in _panels() for t in p["targets"] for m in METRIC.findall(t["expr"])}


async def test_every_queried_metric_is_in_metrics(serve):
    client, _ = await serve()
    # One request of each kind, so the labelled and histogram series have samples.
    body = {"model": "tiny", "messages": CHAT, "max_tokens": 4}
    assert (await client.post("/v1/chat/completions", json=body)).status == 200
    text = await (await client.get("/metrics")).text()
    exported = {s.name for f in text_string_to_metric_families(text) for s in f.samples}
    queried = _queried_metrics()
    assert len(queried) >= 10
    assert queried <= exported, f"not in /metrics: {sorted(queried - exported)}"


def test_the_dashboard_covers_what_operators_watch():
    queried = _queried_metrics()
    for needed in (
        "pagedserve_generation_tokens_total",  # throughput
        "pagedserve_time_to_first_token_seconds_bucket",
        "pagedserve_time_per_output_token_seconds_bucket",
        "pagedserve_kv_cache_usage_ratio",
        "pagedserve_num_preemptions_total",
        "pagedserve_num_requests_waiting",
        "pagedserve_num_requests_swapped",
    ):
        assert needed in queried


def test_panels_use_the_provisioned_data_source_and_do_not_overlap():
    provisioned = yaml.safe_load(
        (DOCKER / "grafana" / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"][0]
    cells = set()
    for panel in _panels():
        assert panel["datasource"]["uid"] == provisioned["uid"]
        assert all(t["datasource"]["uid"] == provisioned["uid"] for t in panel["targets"])
        g = panel["gridPos"]
        mine = {
            (x, y) for x in range(g["x"], g["x"] + g["w"]) for y in range(g["y"], g["y"] + g["h"])
        }
        assert not cells & mine, panel["title"]
        cells |= mine


def test_the_monitoring_profile_mounts_files_that_exist():
    services = load_services({"PAGEDSERVE_API_KEY": "k"})  # compose requires one
    for name in ("prometheus", "grafana"):
        assert services[name]["profiles"] == ["monitoring"]
        for volume in services[name]["volumes"]:
            source = volume.split(":")[0]
            assert (DOCKER / source).exists(), volume
    scrape = yaml.safe_load((DOCKER / "prometheus" / "prometheus.yml").read_text())
    target = scrape["scrape_configs"][0]["static_configs"][0]["targets"][0]
    gateway = services["gateway"]["command"]
    assert target == f"gateway:{gateway[gateway.index('--port') + 1]}"  # the default port

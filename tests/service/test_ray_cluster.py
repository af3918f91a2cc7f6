"""`serve --ray-address` on a local Ray cluster of 1-CPU nodes: ranks and replicas placed on
different nodes serve the right tokens, and a lost node's replica is re-placed without losing
the other replica's requests."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import sys
from pathlib import Path

import aiohttp
import pytest
from transformers import AutoTokenizer

from tests.service.stack_process import (
    HEADERS,
    ServeProcess,
    metric,
    stream,
    stream_completion,
    wait_metric,
)
from tests.support.polling import eventually
from tests.support.reference_model import MAX_NEW_TOKENS

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

MB = 1024 * 1024
# The smallest object store Ray accepts: nothing here goes through it but actor handles.
NODE_ARGS = {"num_cpus": 1, "object_store_memory": 80 * MB}
LONG_TOKENS = 400  # the lost replica's streams still run when its node goes


@pytest.fixture(scope="module")
def cluster():
    """A head that runs no rank (0 CPUs) and two 1-CPU nodes: every rank is alone on a node."""
    head = {"num_cpus": 0, "include_dashboard": False, "object_store_memory": 80 * MB}
    cluster = Cluster(initialize_head=True, head_node_args=head)
    try:
        for _ in range(2):
            cluster.add_node(**NODE_ARGS)
        cluster.wait_for_nodes()
        yield cluster
    finally:
        cluster.shutdown()


def _worker_nodes(cluster) -> dict[str, object]:
    return {node.node_id: node for node in cluster.worker_nodes}


async def _routed(session, url: str) -> list[float]:
    """Requests routed to replicas 0 and 1 so far (a series appears with its first request)."""
    async with session.get(f"{url}/metrics", headers=HEADERS) as response:
        text = await response.text()
    found = dict(
        re.findall(r'^pagedserve_replica_requests_total\{replica="(\d)"\} (\S+)$', text, re.M)
    )
    return [float(found.get(replica, 0)) for replica in ("0", "1")]


def _serve(cluster, model_dir, *extra: str) -> ServeProcess:
    return ServeProcess(
        model_dir, "--ray-address", cluster.address, "--num-device-blocks", "128",
        "--max-num-seqs", "8", "--max-num-batched-tokens", "256", *extra,
    )  # fmt: skip


def test_replicas_keep_off_each_others_nodes_while_another_node_has_room(cluster):
    from ray.util.placement_group import placement_group_table, remove_placement_group

    from services.ray.spread import ReplicaSpread

    ray.init(address=cluster.address)
    try:
        spread, half = ReplicaSpread(), [{"CPU": 0.5}]  # two would fit on one node
        groups = [spread.reserve(i, half, "STRICT_PACK") for i in range(3)]
        nodes = [placement_group_table(g)["bundles_to_node_id"][0] for g in groups]
        assert nodes[0] != nodes[1]
        assert nodes[2] in nodes[:2]  # no free node left: any node rather than none
        for group in groups:
            remove_placement_group(group)
    finally:
        ray.shutdown()


async def test_tensor_parallel_ranks_on_two_nodes_give_transformers_greedy_tokens(
    cluster, tiny_model_dir, prompts, hf_greedy
):
    serve = _serve(
        cluster, tiny_model_dir, "--tensor-parallel-size", "2", "--ray-placement-strategy", "PACK"
    )
    try:
        [nodes] = serve.info["placement"].values()
        # PACK would keep them together if a node had room: with 1-CPU nodes they must span two.
        assert len(set(nodes)) == 2 and set(nodes) <= set(_worker_nodes(cluster))
        async with aiohttp.ClientSession() as session:
            streamed = await asyncio.gather(
                *(
                    stream_completion(session, serve.url, serve.model, p, MAX_NEW_TOKENS)
                    for p in prompts
                )
            )
    finally:
        assert serve.stop() == 0
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    for (text, finish), expected in zip(streamed, hf_greedy):
        assert text == tokenizer.decode(expected, skip_special_tokens=True)
        assert finish == "length"


def test_the_startup_benchmark_times_a_start_on_ray(cluster, tiny_model_dir, tmp_path):
    # Its Ray way only, at one round: the launcher's way is a plain `serve`, started throughout
    # the service tests.
    out = tmp_path / "startup.json"
    script = Path(__file__).resolve().parents[2] / "benchmarks" / "ray_startup.py"
    argv = [sys.executable, str(script), "--model", str(tiny_model_dir), "--rounds", "1",
            "--warmup", "0", "--settle", "0", "--ways", "ray", "--ray-address", cluster.address,
            "--output", str(out)]  # fmt: skip
    subprocess.run(argv, check=True, timeout=300)
    result = json.loads(out.read_text())
    assert result["median_startup_s"]["ray"] > 0
    # Ray's own part of it: connecting the driver, reserving the group and starting the actors.
    assert all(result["median_ray_steps_s"][step] > 0 for step in ("connect", "place"))


@pytest.fixture(scope="module")
def replica_stack(cluster, tiny_model_dir):
    serve = _serve(cluster, tiny_model_dir, "--replicas", "2")
    try:
        yield serve
    finally:
        assert serve.stop() == 0


async def test_two_replicas_on_two_nodes_both_serve(cluster, replica_stack):
    serve = replica_stack
    placement = serve.info["placement"]
    assert len({nodes[0] for nodes in placement.values()}) == 2
    prompts = [[5 + i, 7, 11] for i in range(8)]
    async with aiohttp.ClientSession() as session:
        done = await asyncio.gather(
            *(stream_completion(session, serve.url, serve.model, p, 8) for p in prompts)
        )
        assert all(finish == "length" for _, finish in done)
        assert all(routed > 0 for routed in await _routed(session, serve.url))


async def test_a_lost_node_loses_no_request_of_the_other_replica_and_is_re_placed(
    cluster, replica_stack
):
    serve = replica_stack
    url = serve.url
    lost_node = _worker_nodes(cluster)[serve.info["placement"]["1"][0]]
    body = {"model": serve.model, "prompt": [9, 8, 7, 6], "max_tokens": LONG_TOKENS,
            "temperature": 0, "ignore_eos": True}  # fmt: skip
    async with aiohttp.ClientSession() as session:
        routed_before = await _routed(session, url)
        # Started one by one, each once the previous one streams: with equal costs the router
        # alternates, so streams 0 and 2 run on replica 0, streams 1 and 3 on replica 1.
        streams = []
        for _ in range(4):
            first = asyncio.Event()
            streams.append(
                asyncio.create_task(stream(session, f"{url}/v1/completions", body, first.set))
            )
            await first.wait()
        routed = await _routed(session, url)
        assert [a - b for a, b in zip(routed, routed_before)] == [2, 2]
        # Off the event loop: removing a node waits for its processes to end.
        await asyncio.to_thread(cluster.remove_node, lost_node)
        assert not streams[1].done() and not streams[3].done()  # lost in the middle

        async def degraded() -> bool:
            async with session.get(f"{url}/health") as response:
                return response.status == 200 and (await response.json())["status"] == "degraded"

        # No free CPU anywhere: the replica waits, unplaced, until a node joins.
        await eventually(degraded, 60, 0.1, "/health never said degraded")
        kept = await asyncio.gather(streams[0], streams[2])
        assert await degraded()
        cluster.add_node(**NODE_ARGS)  # on the main thread: it installs signal handlers
        lost = await asyncio.gather(streams[1], streams[3])
        # The other replica's requests ran to their end, untouched.
        for out in kept:
            assert out["error"] is None and out["finish"] == {0: "length"} and out["done"]
        # The lost replica's requests were recomputed on its new ranks (the same greedy text)
        # or ended with an error; none hangs.
        for out in lost:
            assert out["done"] or out["error"] is not None
            if out["error"] is None:
                assert out["texts"] == kept[0]["texts"] and out["finish"] == {0: "length"}
        await wait_metric(session, url, 'pagedserve_replica_replacements_total{replica="1"}', 1)
        assert await metric(session, url, 'pagedserve_replica_replacements_total{replica="0"}') == 0
        await wait_metric(session, url, "pagedserve_kv_blocks_used", 0.0)  # every block freed
        async with session.get(f"{url}/health") as response:
            assert (await response.json())["status"] == "ok"
        # Both serve again.
        again = await asyncio.gather(
            *(stream_completion(session, url, serve.model, [3, 4, 5], 4) for _ in range(4))
        )
        assert all(finish == "length" for _, finish in again)

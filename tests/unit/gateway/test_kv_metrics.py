"""KV memory fractions travel in SchedulerStats over the wire and come out on /metrics."""

from __future__ import annotations

from services.gateway.metrics import GatewayMetrics
from shared.protocol import SchedulerStats, TokenDeltas
from shared.wire import decode, encode


def _stats() -> SchedulerStats:
    return SchedulerStats(
        2, 0, 0, 10, 16, 0, 5,
        kv_policy="orca-pow2",
        kv_fractions={"token_states": 0.25, "reserved": 0.125, "free": 0.625},
        kv_fractions_avg={"token_states": 0.5, "free": 0.5},
    )  # fmt: skip


def test_kv_fractions_survive_the_wire():
    message = decode(encode(TokenDeltas([], _stats())))
    assert message.stats.kv_policy == "orca-pow2"
    assert message.stats.kv_fractions == {"token_states": 0.25, "reserved": 0.125, "free": 0.625}
    assert message.stats.kv_fractions_avg == {"token_states": 0.5, "free": 0.5}


def test_kv_fractions_on_metrics():
    body, _ = GatewayMetrics(_stats).render()
    lines = set(body.decode().splitlines())
    assert 'pagedserve_kv_memory_fraction{kind="token_states"} 0.25' in lines
    assert 'pagedserve_kv_memory_fraction{kind="reserved"} 0.125' in lines
    assert 'pagedserve_kv_memory_fraction_avg{kind="token_states"} 0.5' in lines
    empty, _ = GatewayMetrics(lambda: None).render()
    assert "kv_memory_fraction{" not in empty.decode()


def test_prefix_cache_counters_survive_the_wire_and_come_out_on_metrics():
    stats = SchedulerStats(
        2, 0, 0, 10, 16, 0, 5,
        prefix_cache_queried_tokens=900, prefix_cache_hit_tokens=640, prefix_cache_blocks=12,
    )  # fmt: skip
    message = decode(encode(TokenDeltas([], stats)))
    assert (
        message.stats.prefix_cache_queried_tokens,
        message.stats.prefix_cache_hit_tokens,
        message.stats.prefix_cache_blocks,
    ) == (900, 640, 12)
    body, _ = GatewayMetrics(lambda: message.stats).render()
    lines = set(body.decode().splitlines())
    assert "pagedserve_prefix_cache_queried_tokens_total 900.0" in lines
    assert "pagedserve_prefix_cache_hit_tokens_total 640.0" in lines
    assert "pagedserve_prefix_cache_blocks 12.0" in lines

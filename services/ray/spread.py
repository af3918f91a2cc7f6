"""Replicas kept on different nodes where the cluster allows it: a replica's placement group
first asks for nodes that no other replica holds, and takes any node when none is free (a
re-placement onto a node with another replica beats no replica)."""

from __future__ import annotations

import threading

import ray
from ray.util.placement_group import (
    NODE_ID_LABEL_KEY,
    PlacementGroup,
    placement_group,
    placement_group_table,
    remove_placement_group,
)

TRY_S = 1.0  # how long a constrained group may stay pending before any node will do


class ReplicaSpread:
    def __init__(self) -> None:
        # Replicas reserve one at a time, so that each sees where the others went.
        self._lock = threading.Lock()
        self._nodes: dict[int, set[str]] = {}  # replica -> the nodes its ranks hold

    def reserve(self, index: int, bundles: list[dict], strategy: str) -> PlacementGroup:
        """Replica `index`'s placement group: reserved, or pending while the cluster is full."""
        with self._lock:
            avoid = sorted({n for i, nodes in self._nodes.items() if i != index for n in nodes})
            if avoid:
                elsewhere = [{NODE_ID_LABEL_KEY: f"!in({','.join(avoid)})"}] * len(bundles)
                group = placement_group(bundles, strategy=strategy, bundle_label_selector=elsewhere)
                if _ready_within(group, TRY_S):
                    self.placed(index, group)
                    return group
                remove_placement_group(group)
            group = placement_group(bundles, strategy=strategy)
            if _ready_within(group, TRY_S):
                self.placed(index, group)
            return group

    def placed(self, index: int, group: PlacementGroup) -> None:
        self._nodes[index] = set(placement_group_table(group)["bundles_to_node_id"].values())

    def forget(self, index: int) -> None:
        self._nodes.pop(index, None)


def _ready_within(group: PlacementGroup, timeout_s: float) -> bool:
    ready, _ = ray.wait([group.ready()], timeout=timeout_s)
    return bool(ready)

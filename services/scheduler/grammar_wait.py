"""Requests whose grammar is being compiled: held apart from the waiting queue (no seat, no
block, never in a plan) until the executor answers, their time runs out, or they are aborted."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

from services.scheduler.sequence import SequenceGroup
from shared.protocol import CompileGrammar

# Beyond the compile's own limit (which the executor enforces by killing its worker): the
# worker's start (seconds: it imports xgrammar) and compiles queued ahead of this one. Only an
# executor that never answers, or a queue of compiles too long, makes a request wait this long.
ANSWER_GRACE_S = 30.0


@dataclass
class _Wait:
    group: SequenceGroup
    key: int
    # clock() past which the request ends without its grammar; counted from when its compile
    # was sent (never while the executor is down, when nothing is sent)
    deadline: float = float("inf")


class GrammarWaits:
    def __init__(self, timeout_s: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout_s = timeout_s  # the compile's own limit, named in the errors
        self._clock = clock
        self._by_key: dict[int, _Wait] = {}
        self._key_of: dict[str, int] = {}  # request_id -> the key of its compile request
        self._outbox: list[CompileGrammar] = []  # not sent to the executor yet
        self._next_key = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def pending_specs(self) -> set[tuple[str, str]]:
        """The distinct grammars waited for: requests that share one cost one compile (the
        executor's cache answers the others)."""
        return {w.group.sampling.guided for w in self._by_key.values()}

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._key_of

    def hold(self, group: SequenceGroup) -> None:
        """Ask for the group's grammar; every live sequence will need it (all of them are
        announced afresh after an executor restart)."""
        key = self._next_key
        self._next_key += 1
        self._by_key[key] = _Wait(group, key)
        self._key_of[group.request_id] = key
        kind, spec = group.sampling.guided
        seq_ids = [s.seq_id for s in group.live_seqs()]
        self._outbox.append(CompileGrammar(key, kind, spec, seq_ids))

    def take_requests(self) -> list[CompileGrammar]:
        """The compile requests to send now (each once); their deadlines start now."""
        requests, self._outbox = self._outbox, []
        deadline = self._clock() + self.timeout_s + ANSWER_GRACE_S
        for request in requests:
            self._by_key[request.key].deadline = deadline
        return requests

    def answered(self, key: int) -> SequenceGroup | None:
        """The group this answer is for; None when it no longer waits (aborted, expired, or an
        answer of an executor that has since been replaced)."""
        wait = self._by_key.pop(key, None)
        if wait is None:
            return None
        del self._key_of[wait.group.request_id]
        return wait.group

    def drop(self, request_id: str) -> None:
        key = self._key_of.pop(request_id, None)
        if key is not None:
            del self._by_key[key]
            self._outbox = [r for r in self._outbox if r.key != key]

    def expired(self) -> list[SequenceGroup]:
        now = self._clock()
        late = [w for w in self._by_key.values() if now > w.deadline]
        for wait in late:
            self.drop(wait.group.request_id)
        return [w.group for w in late]

    def clear(self) -> list[SequenceGroup]:
        """Every waiting group, forgotten here (the executor that was asked is gone)."""
        groups = [w.group for w in self._by_key.values()]
        self._by_key.clear()
        self._key_of.clear()
        self._outbox = []
        return groups

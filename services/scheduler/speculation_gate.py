"""Whether a sequence's proposals pay for their place in the step, learned while serving.

A verify step with k proposals returns on average E(a, k) = 1 + a + a^2 + ... + a^k tokens for
a sequence whose proposals are each accepted with probability a (until the first rejection),
and a step of b decoding sequences with x proposals in all takes T(b, x) = T(b, 0) + x * c(b)
seconds. All are measured here: a per sequence from its own verify steps, shrunk towards the
method's recent rate (so a new sequence starts from what the method has been earning); T(b, 0)
and the cost per proposal c(b) from the times of decode-only steps, plan to result (averages
that follow drift; the trips to the executor and back are in T(b, 0), a draft model's passes
in c(b); a step where a sequence starts speculating is averaged apart, as the extra time S(b)
of a start: a draft model first catches up there on every token since its last pass). A
sequence's proposals join a step only if they raise the step's expected tokens per second:

    (tokens + E(a, k) - 1) / T(b, x + k)  >  tokens / T(b, x)

So a draft model that rarely agrees with the target, or a verify row that costs more than its
expected tokens, stops speculating by itself, where a fixed rule (--speculative-max-batch)
would lose on every step. Costs are learnt where they can be: the first step of decodes alone
at a batch size is plain, to time T(b, 0), and so is one in every REFRESH_PLAIN speculating
steps after it (the context grows); until c(b) is known proposals go in, to time it. A batch
size not timed yet borrows the nearest one's costs (at the small batches where speculation
runs, a step's time hardly depends on b). A refused sequence proposes one token now and then
anyway (a probe), since its text may have turned repetitive: after as many refused steps as
keep the probes' cost, c(b) + S(b), within PROBE_BUDGET of the time (prompt lookup's cheap
proposals on a CPU are probed every few steps, a draft model, whose probe pays its catch-up,
far less often), the wait doubling with each rejected probe, at most MAX_DOUBLINGS times.

Refusing proposals is always correct (the sequence decodes one token), so none of this can
change an output; it changes only how many steps the output takes.
"""

from __future__ import annotations

from dataclasses import dataclass

# The sequence's own history is worth PRIOR_WEIGHT observations of the method's rate; each
# verify step keeps SEQ_DECAY of the sequence's past evidence, METHOD_DECAY of the method's.
PRIOR_WEIGHT = 2.0
SEQ_DECAY = 0.8
METHOD_DECAY = 0.95
COST_EMA = 0.2  # weight of a new step time in T's running average
PROBE_BUDGET = 0.05
MAX_DOUBLINGS = 3
REFRESH_PLAIN = 64


def expected_tokens(acceptance: float, k: int) -> float:
    """Tokens a verify step of k proposals returns on average: 1 + a + ... + a^k."""
    return sum(acceptance**j for j in range(k + 1))


@dataclass
class _SeqStats:
    hits: float = 0.0  # accepted proposals (decayed)
    misses: float = 0.0  # rejections: one per verify step that did not accept them all
    refused: int = 0  # steps refused in a row
    rejected_probes: int = 0  # in a row
    probing: bool = False  # its last proposals went in only as a probe


class SpeculationGate:
    def __init__(self) -> None:
        self.hits = 0.0  # the method's, over every sequence (decayed)
        self.misses = 0.0
        self.plain_seconds: dict[int, float] = {}  # b -> T(b, 0)
        self.proposal_seconds: dict[int, float] = {}  # b -> c(b)
        self.start_seconds: dict[int, float] = {}  # b -> extra time of a step where one starts
        self._since_plain: dict[int, int] = {}  # b -> speculating steps timed since T(b, 0)
        self.num_refused = 0  # proposals kept out of steps, since start
        self._seqs: dict[int, _SeqStats] = {}
        self._batch = self._tokens = self._proposed = 0
        self._time_plain = False

    # ---- one step's plan --------------------------------------------------------------------
    def start_step(self, num_seqs: int, decodes_only: bool) -> None:
        """A plan begins for a batch of num_seqs sequences; decodes_only: none of them has
        prompt tokens left and none waits to start (so the step can time T(b, 0))."""
        self._batch, self._tokens, self._proposed = num_seqs, num_seqs, 0
        since = self._since_plain.get(num_seqs)
        self._time_plain = decodes_only and (since is None or since >= REFRESH_PLAIN)

    def admit(self, seq_id: int, k: int) -> int:
        """How many of the sequence's k proposals go into this step: k, 1 (a probe) or 0; the
        step's tally counts them."""
        if self._time_plain:
            return 0
        stats = self._seqs.setdefault(seq_id, _SeqStats())
        plain = _nearest(self.plain_seconds, self._batch)
        per_proposal = _nearest(self.proposal_seconds, self._batch)
        stats.probing = False
        acceptance = self.acceptance(stats)
        if plain is not None and per_proposal is not None:
            gain = expected_tokens(acceptance, k) - 1.0
            now = plain + per_proposal * self._proposed
            if (self._tokens + gain) * now <= self._tokens * (now + per_proposal * k):
                start = _nearest(self.start_seconds, self._batch) or 0.0
                probe_after = round((per_proposal + start) / (PROBE_BUDGET * plain))
                if stats.refused < probe_after << min(stats.rejected_probes, MAX_DOUBLINGS):
                    stats.refused += 1
                    self.num_refused += k
                    return 0
                # One proposal is enough to see whether it is accepted now, at a third of
                # the price of K (a draft model's pass and a verify row each).
                stats.probing = True
                k = 1
        # else: explore, the cost of proposals is learnt by timing them
        stats.refused = 0
        self._tokens += expected_tokens(acceptance, k) - 1.0
        self._proposed += k
        return k

    # ---- what the executor reports ------------------------------------------------------------
    def verified(self, seq_id: int, proposed: int, accepted: int) -> None:
        """A verify step of the sequence accepted `accepted` of its `proposed` proposals."""
        stats = self._seqs.setdefault(seq_id, _SeqStats())
        missed = 1.0 if accepted < proposed else 0.0
        stats.hits = stats.hits * SEQ_DECAY + accepted
        stats.misses = stats.misses * SEQ_DECAY + missed
        self.hits = self.hits * METHOD_DECAY + accepted
        self.misses = self.misses * METHOD_DECAY + missed
        if stats.probing:
            stats.probing = False
            stats.rejected_probes = stats.rejected_probes + 1 if accepted == 0 else 0

    def step_timed(
        self, num_seqs: int, num_proposed: int, seconds: float, starting: bool = False
    ) -> None:
        """A decode-only step of num_seqs sequences and num_proposed proposals took seconds;
        starting: some sequence began proposing in it (its extra time is a start's cost)."""
        if num_proposed == 0:
            _average(self.plain_seconds, num_seqs, seconds)
            self._since_plain[num_seqs] = 0
            return
        plain = _nearest(self.plain_seconds, num_seqs)
        if plain is None:
            return
        if starting:
            per_proposal = _nearest(self.proposal_seconds, num_seqs)
            if per_proposal is not None:
                extra = seconds - plain - per_proposal * num_proposed
                _average(self.start_seconds, num_seqs, max(0.0, extra))
            return
        _average(self.proposal_seconds, num_seqs, max(0.0, (seconds - plain) / num_proposed))
        if num_seqs in self._since_plain:
            self._since_plain[num_seqs] += 1

    def forget(self, seq_id: int) -> None:
        self._seqs.pop(seq_id, None)

    # ---- estimates ----------------------------------------------------------------------------
    def method_acceptance(self) -> float:
        """The method's recent per-proposal acceptance (0.5 before any evidence)."""
        return (self.hits + 1.0) / (self.hits + self.misses + 2.0)

    def acceptance(self, stats: _SeqStats) -> float:
        prior = self.method_acceptance()
        return (stats.hits + PRIOR_WEIGHT * prior) / (stats.hits + stats.misses + PRIOR_WEIGHT)


def _average(averages: dict[int, float], key: int, value: float) -> None:
    old = averages.get(key)
    averages[key] = value if old is None else old + COST_EMA * (value - old)


def _nearest(averages: dict[int, float], key: int) -> float | None:
    """The average at key, else at the nearest key measured (the smaller on a tie)."""
    if key in averages:
        return averages[key]
    if not averages:
        return None
    return averages[min(averages, key=lambda k: (abs(k - key), k))]

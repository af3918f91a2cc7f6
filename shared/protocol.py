"""Messages between scheduler and executor: plain-value records, one per direction per step.

The in-process engine passes these objects directly; the service layer encodes the same records
with msgpack. Nothing here holds a tensor, so every field can cross a process boundary as is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from shared.sampling import SamplingParams
from shared.structured import GrammarLimits


@dataclass(frozen=True)
class ExecutorReady:
    """What the executor announces once its model is loaded and its KV pools are allocated."""

    num_device_blocks: int
    num_cpu_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    # "cpu", "cuda" or "sim" (a modelled GPU): the scheduler's defaults depend on it.
    device_type: str = "cuda"
    # Tokens of context whose attention costs one query token as much as the rest of its
    # forward pass (the linear layers and the LM head): a prompt chunk at context c costs about
    # (1 + c / context_cost_tokens) times its context-free cost. 0: not modelled.
    context_cost_tokens: int = 0
    # A chunk's attention reads its whole cached context once per layer, whatever its rows: that
    # read costs as much as this many rows' attention. Where it is set (the CPU reference
    # backend) the executor also computes a chunk's layers in parts over several steps
    # (ScheduledSeq.layers), so that a deep chunk's read need not fall on one step. 0: neither.
    context_read_rows: float = 0.0
    num_layers: int = 0  # decoder layers: what ScheduledSeq.layers counts
    # Sampling defaults from the checkpoint's generation_config.json (--generation-config auto)
    # for requests that leave them unset: temperature, top_p, top_k, min_p, repetition_penalty.
    default_sampling: dict[str, float] = field(default_factory=dict)
    # When every layer attends within a sliding window: the largest window in tokens, and the
    # scheduler frees the blocks behind it. None when any layer sees the whole context.
    sliding_window: int | None = None
    # longrope (Phi-3) served beyond its original context: a sequence that outgrows this many
    # tokens is recomputed whole with the long factors (as transformers' generate does), and the
    # prefix cache is off (a block's K/V depends on its sequence's length). None otherwise.
    rope_switch_len: int | None = None


# In a plan made while the step before it still ran (async scheduling): "the token you sampled
# for this sequence in the previous step", which only the executor knows yet.
PENDING_TOKEN = -1

# In a speculating sequence's token_ids: a proposal slot that the executor's draft model fills in
# before the target model runs (--speculative-method draft); the scheduler cannot know it.
DRAFT_TOKEN = -2


@dataclass
class PromptTargets:
    """The prompt tokens whose logprobs a chunk's rows give: row first_row + j scores
    token_ids[j] (row i of the chunk predicts the token at start_pos + i + 1)."""

    first_row: int
    token_ids: list[int]


@dataclass
class ScheduledSeq:
    """One sequence's share of a step."""

    seq_id: int
    token_ids: list[int]  # [num_new_tokens] tokens whose K/V this step computes
    start_pos: int  # position of token_ids[0] in the sequence (= tokens already cached)
    block_ids: list[int]  # the whole block table if replace_table, else blocks appended since
    replace_table: bool  # the executor's cached table for this seq is stale: replace it
    sample: bool  # sample from the logits of the last token (False for a non-final prompt chunk)
    # n > 1 only, on the step that finishes the prompt: further sequences (forked from this one
    # after the step) that each sample their own first token from the same logits.
    fork_seq_ids: list[int] = field(default_factory=list)
    sampling: SamplingParams | None = None  # sent on the sequence's first appearance only
    # Also only with `sampling`: what an executor that never saw the group (a restarted one)
    # cannot learn from the tokens, so that draws keyed by (seed, sample index, output position)
    # repeat exactly: the sample's index among the request's samples and the prompt's length.
    sample_index: int = 0
    prompt_len: int | None = None
    # The sequence's length when this entry was planned, where the entry holds tokens before
    # the sequence's last (a prompt's chunks, a recompute), else None: longrope picks its
    # tables by it, as transformers picks them by the length of the whole sequence it computes.
    rope_len: int | None = None
    # Prompt logprobs: the prompt tokens this chunk's rows score; None (most plans) costs a byte.
    prompt_targets: PromptTargets | None = None
    # Speculative decoding: the last num_spec_tokens entries of token_ids are proposed tokens
    # (or DRAFT_TOKEN slots) to verify, token_ids = [last real token, d1 .. dK], sample=True.
    # The executor returns 1 .. num_spec_tokens + 1 tokens for the sequence: the accepted
    # proposals, then the corrected (or bonus) token.
    num_spec_tokens: int = 0
    # A deep prompt chunk computed in parts (ExecutorReady.context_read_rows): this entry runs
    # decoder layers [first, end) of its tokens only. The part with first 0 starts the chunk (its
    # K/V slots are new); the next parts, in the following steps, carry the same tokens and take
    # up where the last one stopped; only the part that ends at the last layer samples.
    # Parts come last in a plan, after every other entry.
    layers: tuple[int, int] | None = None


@dataclass
class StepPlan:
    """Everything the executor does in one iteration, in order: swap out, swap in, copy, forward."""

    step_id: int
    seqs: list[ScheduledSeq]  # batch order; the executor returns tokens in the same order
    swap_out: list[tuple[int, int]] = field(default_factory=list)  # (device_block, cpu_block)
    swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu_block, device_block)
    copies: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) device copy-on-write
    freed_seq_ids: list[int] = field(default_factory=list)  # the executor may forget these

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)


@dataclass
class SampledToken:
    seq_id: int
    token_id: int
    logprob: float | None = None  # log-probability of token_id under the model, if asked
    top_logprobs: list[tuple[int, float]] = field(default_factory=list)  # [(token_id, logprob)]


@dataclass
class PromptLogprobs:
    """Logprobs of a run of prompt tokens under the model, read from a prefill's logits."""

    seq_id: int
    start_pos: int  # position of the first token scored (>= 1: position 0 has no logprob)
    tokens: list[SampledToken]  # one per scored prompt token, in order, with its top logprobs
    ranks: list[int]  # each token's rank among its row's logprobs (1: the most likely)


@dataclass
class StepResult:
    step_id: int
    # One per sampled sequence, plan order, children after parent; a speculating sequence
    # (num_spec_tokens > 0) gets 1 .. num_spec_tokens + 1 consecutive entries: its accepted
    # proposals in order, then the corrected or bonus token.
    tokens: list[SampledToken]
    timings: dict[str, float] = field(default_factory=dict)  # seconds per executor phase
    error: str | None = None  # set when the step failed; the scheduler ends its requests
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)  # plan order
    # Speculative decoding, this step: proposed tokens verified, and those accepted.
    num_proposed: int = 0
    num_accepted: int = 0


# ---- scheduler <-> gateway --------------------------------------------------------------------


@dataclass(frozen=True)
class SchedulerReady:
    """Sent to the gateway once the executor is up and the block manager is built."""

    executor: ExecutorReady
    max_num_seqs: int
    model_name: str  # what /v1/models reports and requests must name
    grammar_limits: GrammarLimits = field(default_factory=GrammarLimits)  # checked at the gateway
    model_aliases: tuple[str, ...] = ()  # further names requests may use (--served-model-name)


@dataclass
class GenerateRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival_time: float  # time.time() when the gateway accepted it


@dataclass
class AbortRequest:
    request_id: str


@dataclass
class GatewayHello:
    """Gateway -> scheduler, whenever its connection (re)opens: asks for SchedulerReady. The
    scheduler knows which gateway sent it (and every request) from the connection itself."""


@dataclass
class SeqDelta:
    """New tokens of one of a request's n samples since the last delta."""

    index: int  # which sample (0 .. n-1)
    token_ids: list[int]
    logprobs: list[SampledToken] = field(default_factory=list)  # one per token, if asked
    finish_reason: str | None = None  # set once the sample has ended
    cumulative_logprob: float | None = None  # beam search: the hypothesis' summed logprobs


@dataclass
class RequestDelta:
    request_id: str
    seqs: list[SeqDelta]
    finished: bool  # the request's last message: every sample has ended
    # OpenAI-style {"message", "type", "param", "code"} when the scheduler rejected or failed it
    error: dict | None = None
    num_prompt_tokens: int = 0
    # Asked-for prompt logprobs, whole (positions 1 ..), in the first delta once they are known.
    prompt_logprobs: PromptLogprobs | None = None


@dataclass
class SchedulerStats:
    """Gauges and counters the gateway exports on /metrics; sent with every delta batch."""

    num_running: int  # sequences
    num_waiting: int  # requests (groups) not yet admitted or preempted by recompute
    num_swapped: int  # requests preempted by swap
    kv_blocks_used: int
    kv_blocks_total: int
    num_preemptions: int  # since start
    num_steps: int  # since start
    step_scheduler_s: float = 0.0  # last step: schedule() + update() in the scheduler
    step_executor_s: float = 0.0  # last step: the executor's own time (plan in, result out)
    step_roundtrip_s: float = 0.0  # last step: plan sent -> result received, as seen by scheduler
    executor_alive: bool = True  # the executor's heartbeat is fresh
    executor_restarting: bool = False  # the executor died; its requests wait for a new one
    num_executor_restarts: int = 0  # executors lost and replaced since start
    kv_policy: str = "paged"  # the KV allocation policy
    # Device KV slots by kind (token_states, reserved, internal_fragmentation,
    # external_fragmentation, free) as fractions of the pool: after the last step, and averaged
    # over the time since start (weighted by step duration).
    kv_fractions: dict[str, float] = field(default_factory=dict)
    kv_fractions_avg: dict[str, float] = field(default_factory=dict)
    # Prefix cache, since start: prompt (and recomputed) tokens of admitted sequences looked up,
    # and those found with their K/V already in the cache; device blocks findable now.
    prefix_cache_queried_tokens: int = 0
    prefix_cache_hit_tokens: int = 0
    prefix_cache_blocks: int = 0
    # Speculative decoding, since start: the method ("" when off), tokens proposed and verified,
    # and those accepted.
    spec_method: str = ""
    spec_proposed_tokens: int = 0
    spec_accepted_tokens: int = 0


@dataclass
class NextTokens:
    """Most requests' deltas of a decode step, as columns: one new token each of a request with
    one sample that goes on and asks for no logprobs (the delta's every other field at its
    default). Built and encoded as a record per request, they were most of the scheduler's
    per-step delta work (docs/benchmarks.md, "deltas as columns"); these are three lists.
    delta(i) is the RequestDelta they stand for."""

    request_ids: list[str] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    num_prompt_tokens: list[int] = field(default_factory=list)

    def add(self, request_id: str, token_id: int, num_prompt_tokens: int) -> None:
        self.request_ids.append(request_id)
        self.token_ids.append(token_id)
        self.num_prompt_tokens.append(num_prompt_tokens)

    def delta(self, i: int) -> RequestDelta:
        return RequestDelta(
            self.request_ids[i],
            [SeqDelta(0, [self.token_ids[i]])],
            False,
            None,
            self.num_prompt_tokens[i],
        )


@dataclass
class TokenDeltas:
    """One message per step (or heartbeat) from the scheduler to the gateway."""

    deltas: list[RequestDelta]
    stats: SchedulerStats
    next_tokens: NextTokens | None = None  # the step's plain one-token deltas, if any

    def all_deltas(self) -> list[RequestDelta]:
        """Every delta of the message as a record, the columns' after the others."""
        plain = self.next_tokens
        if plain is None:
            return self.deltas
        return self.deltas + [plain.delta(i) for i in range(len(plain.request_ids))]


@dataclass
class CompileGrammar:
    """Scheduler -> executor, beside the plans: compile this request's grammar off the step loop
    and keep it for these sequences, whose first plan entries will need it. Answered by
    GrammarCompiled; the request is not scheduled before."""

    key: int  # the scheduler's id of this compile request, echoed in the answer
    kind: str  # one of shared.sampling's guided kinds
    spec: str
    seq_ids: list[int]  # the sequences whose matchers the grammar makes (their first appearance)


@dataclass
class ForgetGrammars:
    """Scheduler -> executor, beside the plans and sent at once: these sequences' requests ended
    while waiting for their grammar (aborted, expired, failed). The executor drops their queued
    compiles and held grammars, and kills a compile that ran for them alone."""

    seq_ids: list[int]


@dataclass
class GrammarCompiled:
    """Executor -> scheduler: CompileGrammar `key` is done; error is None when the grammar is
    ready, else why it is not: error_type "invalid_request_error" for the spec's own fault (it
    is invalid, or its compile ran past the time limit), "rate_limit_error" when it waited
    behind other compiles past the limit (retry later), "service_unavailable_error" for the
    server's (the compiler did not start, crashed, or failed inside)."""

    key: int
    error: str | None = None
    error_type: str = "invalid_request_error"


@dataclass
class ExecutorHeartbeat:
    """Sent by the executor every second, also mid-step, so a dead executor is noticed."""

    pid: int


@dataclass
class Shutdown:
    """Asks a process to exit cleanly."""

    reason: str = ""


# ---- KV state (the live block map of GET /v1/kv_state and /dashboard) -------------------------


@dataclass
class KvStateRequest:
    """Gateway -> scheduler: send a KvState now. Sent only while someone polls the block map, so
    the per-step path never builds one."""


@dataclass
class KvRequestState:
    """One request as the block map shows it."""

    request_id: str
    status: str  # "running" | "waiting" | "swapped"
    num_seqs: int  # live sequences (parallel samples)
    num_prompt_tokens: int
    num_output_tokens: int  # of its longest sample
    num_blocks: int  # distinct blocks held: device blocks, or CPU blocks when swapped


@dataclass
class PreemptionEvent:
    time: float  # time.time() of the step that preempted
    request_id: str
    mode: str  # "swap" | "recompute"


@dataclass
class KvState:
    """The block pools at one instant: who holds each block and how many references it has."""

    time: float  # time.time() when taken
    block_size: int
    # Per-block arrays are int32 little-endian bytes (shared/packed.py): one memcpy on the wire.
    device_ref_counts: bytes  # [num_device_blocks] 0 = free, > 1 = shared
    device_owners: bytes  # [num_device_blocks] index into requests, -1 = free
    cpu_ref_counts: bytes  # [num_cpu_blocks] blocks of swapped requests
    cpu_owners: bytes  # [num_cpu_blocks] index into requests, -1 = free
    cached_block_ids: list[int]  # free device blocks still holding a reusable prefix
    requests: list[KvRequestState]  # running, then swapped, then waiting; arrival order within
    preemptions: list[PreemptionEvent]  # the most recent ones, oldest first
    num_preemptions: int  # since start

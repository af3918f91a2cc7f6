"""The executor's per-sequence sampling state and the step's SamplingBatch built from it.

What a sequence has generated is learned from the tokens the plans feed it (a sampled token is
fed back one step later, before the next draw), never from the sampler's own output. So penalty
counts, grammar matchers and draw positions survive preemption by recompute (tokens already
seen are skipped by position) and need no extra messages.
"""

from __future__ import annotations

import copy
import itertools
import random
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, NamedTuple

import numpy as np
import torch

from kernels.metadata import host_to_device, int64_tensor
from services.executor.counter_rng import position_keys, sample_key
from services.executor.sampler import PenaltyInputs, SamplerOutput, SamplingBatch
from shared.protocol import PENDING_TOKEN, SampledToken, ScheduledSeq
from shared.sampling import SamplingParams


@dataclass
class SeqSampling:
    params: SamplingParams
    seed: int  # the request's seed, or one drawn for it: every draw is keyed by it
    sample_index: int  # which of the request's parallel samples
    prompt_len: int | None = None  # known once the prompt is fed (the first draw)
    num_seen: int = 0  # tokens (by position) already fed and recorded
    penalty_slot: int | None = None  # row of the PenaltyTable, penalised sequences only
    matcher: Any = None  # xgrammar.GrammarMatcher for structured output
    bias: LogitBias | None = None  # built once when added; forks share it
    key: int = field(init=False)  # sample_key(seed, sample_index): a draw's key is one mix

    def __post_init__(self) -> None:
        self.key = sample_key(self.seed, self.sample_index)

    @property
    def num_outputs(self) -> int:
        """Generated tokens so far (the next draw's position among the outputs)."""
        return self.num_seen - self.prompt_len if self.prompt_len is not None else 0


@dataclass(frozen=True)
class LogitBias:
    """A request's logit_bias on the device, so that no step walks its entries in Python: a
    [vocab] fp32 row (zero where unset) when it names many tokens, else its ids and values."""

    row: torch.Tensor | None
    ids: torch.Tensor | None = None  # [K] int64
    values: torch.Tensor | None = None  # [K] fp32


# A bias naming at least vocab / DENSE_BIAS_DIVISOR tokens is a dense row: on a CPU a step's
# cost of a dense row and of about vocab / 12 sparse entries are even (measured by
# benchmarks/logit_bias_cost.py); smaller biases stay sparse, cheaper than copying whole rows.
DENSE_BIAS_DIVISOR = 8


class Draw(NamedTuple):
    """One token to draw this step (a tuple: a step's list of them compares in C, see build)."""

    logits_row: int
    seq_id: int
    # Speculative decoding: the draw at the i-th verified row is i outputs further on (its key's
    # position), as the plain draw of that token would be.
    offset: int = 0


@dataclass
class _Layout:
    """The fixed part of a step's SamplingBatch, kept for the next step with the same draws."""

    draws: list[Draw]
    generation: int  # SamplingStates._generation when built
    states: list[SeqSampling]  # per draw
    batch: SamplingBatch  # rng_keys all zero; penalties, edits and grammar not added
    random_rows: list[int]  # draws that are not greedy: they need keys
    random_index: torch.Tensor  # [R] int64 the same, on the host
    sample_keys: np.ndarray  # [R] uint64 their sample keys
    random_states: list[SeqSampling]  # [R] their states
    # [R] int64 offset - prompt_len of each: a draw's position is num_seen plus this. None
    # when some prompt length was still unknown (then read per row, as num_outputs).
    position_shift: np.ndarray | None
    special: bool  # some row has penalties, a bias, min_tokens or a grammar


class PenaltyTable:
    """Per-sequence token counts on the device: [slots, vocab] outputs and prompt presence."""

    def __init__(self, vocab_size: int, device: torch.device) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.output_counts = torch.zeros(0, vocab_size, dtype=torch.int32, device=device)
        self.prompt_mask = torch.zeros(0, vocab_size, dtype=torch.bool, device=device)
        self._free: list[int] = []

    def acquire(self) -> int:
        if not self._free:
            old = self.output_counts.shape[0]
            new = max(8, 2 * old)
            counts = torch.zeros(new, self.vocab_size, dtype=torch.int32, device=self.device)
            mask = torch.zeros(new, self.vocab_size, dtype=torch.bool, device=self.device)
            counts[:old] = self.output_counts
            mask[:old] = self.prompt_mask
            self.output_counts, self.prompt_mask = counts, mask
            self._free = list(range(new - 1, old - 1, -1))
        return self._free.pop()

    def release(self, slot: int) -> None:
        self.output_counts[slot] = 0
        self.prompt_mask[slot] = False
        self._free.append(slot)

    def copy(self, src: int, dst: int) -> None:
        self.output_counts[dst] = self.output_counts[src]
        self.prompt_mask[dst] = self.prompt_mask[src]

    def record_on_device(self, slots: torch.Tensor, tokens: torch.Tensor) -> None:
        """Add one output each: [N] int64 slots, [N] int64 token ids already on the device."""
        ones = torch.ones(slots.shape[0], dtype=torch.int32, device=self.device)
        self.output_counts.index_put_((slots, tokens), ones, accumulate=True)

    def record(self, prompt: list[tuple[int, int]], outputs: list[tuple[int, int]]) -> None:
        """Add (slot, token) pairs: one scatter per kind per step."""
        if prompt:
            slots, tokens = _pairs(prompt, self.device)
            self.prompt_mask[slots, tokens] = True
        if outputs:
            slots, tokens = _pairs(outputs, self.device)
            ones = torch.ones(len(outputs), dtype=torch.int32, device=self.device)
            self.output_counts.index_put_((slots, tokens), ones, accumulate=True)


def _pairs(pairs: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, ...]:
    both = host_to_device(torch.tensor(pairs, dtype=torch.int64).T.contiguous(), device)
    return both[0], both[1]


class SamplingStates:
    def __init__(
        self,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        seed: int,
        make_matcher: Callable[[int, tuple[str, str]], Any],  # (seq_id, guided) -> matcher
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        self.device = device
        self.seqs: dict[int, SeqSampling] = {}
        self.penalties = PenaltyTable(vocab_size, device)
        self._seeds = random.Random(seed)  # seeds for requests that bring none
        self._make_matcher = make_matcher
        self._make_bitmask: Callable[[int], torch.Tensor] | None = None
        self._pending_prompt: list[tuple[int, int]] = []
        self._pending_outputs: list[tuple[int, int]] = []
        # Bumped whenever a sequence is added, forked or forgotten: a cached layout names
        # state objects, valid only while none of them has been replaced.
        self._generation = 0
        self._layout: _Layout | None = None
        # (penalty slot, seq_id) of outputs fed as PENDING_TOKEN: still on the device, counted
        # there by count_device_outputs() once the step's inputs are filled in.
        self._device_outputs: list[tuple[int, int]] = []
        # Sequences with a grammar whose last output was fed as PENDING_TOKEN: their matcher
        # takes it in accept_deferred(), once the step that sampled it has reached the host.
        self._deferred_matchers: list[int] = []

    def __contains__(self, seq_id: int) -> bool:
        return seq_id in self.seqs

    def add(
        self,
        seq_id: int,
        params: SamplingParams,
        sample_index: int = 0,
        prompt_len: int | None = None,
    ) -> None:
        seed = params.seed if params.seed is not None else self._seeds.getrandbits(63)
        state = SeqSampling(params, seed, sample_index, prompt_len)
        if params.has_penalties:
            state.penalty_slot = self.penalties.acquire()
        if params.logit_bias:
            state.bias = self._logit_bias(params.logit_bias)
        if params.guided is not None:
            state.matcher = self._make_matcher(seq_id, params.guided)
        self._put(seq_id, state)

    def forget(self, seq_id: int) -> None:
        state = self.seqs.pop(seq_id, None)
        self._generation += 1
        if state is not None and state.penalty_slot is not None:
            self._flush()  # queued pairs of this slot must land before it is cleared and reused
            self.penalties.release(state.penalty_slot)

    def fork(self, parent_id: int, child_id: int, sample_index: int) -> None:
        """A parallel sample: the parent's history (so far only its prompt), its own draws."""
        parent = self.seqs[parent_id]
        child = replace(parent, sample_index=sample_index, penalty_slot=None, matcher=None)
        if parent.penalty_slot is not None:
            self._flush()
            child.penalty_slot = self.penalties.acquire()
            self.penalties.copy(parent.penalty_slot, child.penalty_slot)
        if parent.matcher is not None:
            child.matcher = parent.matcher.fork()
        self._put(child_id, child)

    def _put(self, seq_id: int, state: SeqSampling) -> None:
        self.seqs[seq_id] = state
        self._generation += 1

    def observe(self, seq_id: int, token_ids: list[int], start_pos: int, samples: bool) -> None:
        """Record the tokens a plan feeds a sequence (prompt chunks, recompute, last token)."""
        state = self.seqs[seq_id]
        end = start_pos + len(token_ids)
        if _plain(state):  # most steps of most sequences: only the count of tokens seen moves
            state.num_seen = max(state.num_seen, end)
            return
        if state.prompt_len is None and samples:
            state.prompt_len = end  # a sequence first samples when its whole prompt is in
        first_new = max(start_pos, state.num_seen)
        if first_new < end:
            fresh = token_ids[first_new - start_pos :]
            prompt_end = state.prompt_len if state.prompt_len is not None else end
            split = max(0, min(len(fresh), prompt_end - first_new))
            prompt, outputs = fresh[:split], fresh[split:]
            pending = outputs[-1:] == [PENDING_TOKEN]  # sampled last step, still on the device
            if pending:
                outputs = outputs[:-1]
            slot = state.penalty_slot
            if slot is not None:
                self._pending_prompt.extend((slot, t) for t in prompt)
                if pending:
                    self._device_outputs.append((slot, seq_id))
                self._pending_outputs.extend((slot, t) for t in outputs)
            if state.matcher is not None:
                for token in outputs:
                    state.matcher.accept_token(token)
                if pending:
                    self._deferred_matchers.append(seq_id)
            state.num_seen = end

    def observe_plan(self, seqs: list[ScheduledSeq]) -> None:
        """observe() for every entry of a plan, in one pass. Proposed tokens are not the
        sequence's until verified: the next plan feeds the accepted ones."""
        states = self.seqs
        # A failed step's, if any: they belong to its plan alone.
        self._device_outputs, self._deferred_matchers = [], []
        for seq in seqs:
            state = states[seq.seq_id]
            k = seq.num_spec_tokens
            end = seq.start_pos + len(seq.token_ids) - k
            # _plain(state), inlined: a call per entry is a tenth of this loop at batch 256.
            plain = state.penalty_slot is None and state.matcher is None
            if plain and state.prompt_len is not None:
                if end > state.num_seen:
                    state.num_seen = end
            else:
                real = seq.token_ids[:-k] if k else seq.token_ids
                self.observe(seq.seq_id, real, seq.start_pos, seq.sample)

    def _flush(self) -> None:
        self.penalties.record(self._pending_prompt, self._pending_outputs)
        self._pending_prompt, self._pending_outputs = [], []

    def build(self, draws: list[Draw]) -> SamplingBatch:
        """The step's per-row parameters as device tensors. Most decode steps draw for the same
        rows as the step before: their fixed part (parameters, rows, flags) is then reused and
        only the draw keys are new (vLLM keeps a persistent batch for the same reason)."""
        self._flush()
        layout = self._layout
        if layout is None or layout.generation != self._generation or layout.draws != draws:
            layout = self._layout = self._new_layout(draws)
        states = layout.states
        rng_keys = layout.batch.rng_keys  # all zero: greedy rows draw nothing
        if layout.random_rows:
            if layout.position_shift is not None:
                seen = np.array([state.num_seen for state in layout.random_states], np.int64)
                positions = seen + layout.position_shift
            else:
                positions = [states[i].num_outputs + draws[i].offset for i in layout.random_rows]
            keys = position_keys(layout.sample_keys, positions)
            if len(layout.random_rows) < len(draws):
                keys = torch.zeros(len(draws), dtype=torch.int64).index_copy_(
                    0, layout.random_index, keys
                )
            rng_keys = host_to_device(keys, self.device)
        batch = copy.copy(layout.batch)  # a shallow copy: half of replace()'s cost
        batch.rng_keys = rng_keys
        if layout.special:  # penalties, biases, min_tokens or grammars: built every step
            self._add_penalties(batch, states)
            self._add_edits(batch, states)
            self._add_grammar(batch, states)
        return batch

    def _new_layout(self, draws: list[Draw]) -> _Layout:
        states = [self.seqs[d.seq_id] for d in draws]
        params = [s.params for s in states]
        vocab = self.vocab_size
        top_k = [p.top_k if 0 < p.top_k < vocab else vocab for p in params]
        used_k = [k for k in top_k if k < vocab]
        # Rows padded to a multiple of 4 entries: each row of the two uploads then starts 16
        # bytes aligned, as a fresh tensor does, so that a Triton kernel reading them (the
        # fused sampler) is not compiled again for another alignment at another batch size.
        n, pad = len(draws), [0] * (-len(draws) % 4)
        floats = torch.tensor(
            [
                [0.0 if p.greedy else p.temperature for p in params] + pad,
                [p.top_p if p.top_p < 1.0 else float("inf") for p in params] + pad,
                [p.min_p for p in params] + pad,
            ],
            dtype=torch.float32,
        )
        ints = torch.tensor([[d.logits_row for d in draws] + pad, top_k + pad], dtype=torch.int64)
        floats, ints = host_to_device(floats, self.device), host_to_device(ints, self.device)
        floats, ints = floats[:, :n], ints[:, :n]
        asked = [p.num_top_logprobs(self.eos_token_ids) for p in params if p.wants_logprob]
        # Greedy rows draw nothing: their keys are never read.
        random_rows = [i for i, p in enumerate(params) if not p.greedy]
        zeros = torch.zeros(len(draws), dtype=torch.int64)
        batch = SamplingBatch(
            logits_rows=ints[0],
            rows_identity=all(d.logits_row == i for i, d in enumerate(draws)),
            temperature=floats[0],
            top_k=ints[1],
            max_top_k=max(used_k, default=1),
            top_p=floats[1],
            min_p=floats[2],
            rng_keys=host_to_device(zeros, self.device),
            all_greedy=not random_rows,
            use_top_k=bool(used_k),
            use_top_p=any(p.top_p < 1.0 for p in params),
            use_min_p=any(p.min_p > 0.0 for p in params),
            num_logprobs=min(max(asked), vocab) if asked else -1,
            every_row_filtered=bool(random_rows)
            and all(params[i].top_p < 1.0 or top_k[i] < vocab for i in random_rows),
        )
        special = any(
            s.penalty_slot is not None
            or s.bias is not None
            or s.matcher is not None
            or s.params.min_tokens > 0
            for s in states
        )
        return _Layout(
            draws=list(draws),
            generation=self._generation,
            states=states,
            batch=batch,
            random_rows=random_rows,
            random_index=torch.tensor(random_rows, dtype=torch.int64),
            sample_keys=np.array([states[i].key for i in random_rows], np.uint64),
            random_states=[states[i] for i in random_rows],
            position_shift=(
                np.array([draws[i].offset - states[i].prompt_len for i in random_rows], np.int64)
                if all(states[i].prompt_len is not None for i in random_rows)
                else None
            ),
            special=special,
        )

    def _add_penalties(self, batch: SamplingBatch, states: list[SeqSampling]) -> None:
        rows = [i for i, s in enumerate(states) if s.penalty_slot is not None]
        if not rows:
            return
        slots = host_to_device(torch.tensor([states[i].penalty_slot for i in rows]), self.device)
        values = torch.tensor(
            [
                [states[i].params.presence_penalty for i in rows],
                [states[i].params.frequency_penalty for i in rows],
                [states[i].params.repetition_penalty for i in rows],
            ],
            dtype=torch.float32,
        )
        values = host_to_device(values, self.device)
        batch.penalties = PenaltyInputs(
            rows=host_to_device(torch.tensor(rows), self.device),
            output_counts=self.penalties.output_counts.index_select(0, slots),
            prompt_mask=self.penalties.prompt_mask.index_select(0, slots),
            presence=values[0],
            frequency=values[1],
            repetition=values[2],
        )

    def _logit_bias(self, logit_bias: tuple[tuple[int, float], ...]) -> LogitBias:
        ids = host_to_device(torch.tensor([t for t, _ in logit_bias]), self.device)
        values = torch.tensor([b for _, b in logit_bias], dtype=torch.float32)
        values = host_to_device(values, self.device)
        if len(logit_bias) * DENSE_BIAS_DIVISOR < self.vocab_size:
            return LogitBias(None, ids, values)
        row = torch.zeros(self.vocab_size, dtype=torch.float32, device=self.device)
        return LogitBias(row.index_put_((ids,), values))

    def _add_edits(self, batch: SamplingBatch, states: list[SeqSampling]) -> None:
        """logit_bias (dense rows as one add of whole rows, sparse ones as edits), and -inf on
        eos and stop tokens for rows still short of min_tokens: one pass in Python per row,
        never per bias entry."""
        dense: list[int] = []
        sparse: list[int] = []
        rows: list[int] = []
        tokens: list[int] = []
        values: list[float] = []
        for i, state in enumerate(states):
            if state.bias is not None:
                (sparse if state.bias.row is None else dense).append(i)
            p = state.params
            if state.num_outputs < p.min_tokens:
                banned = set(p.stop_token_ids)
                if not p.ignore_eos:
                    banned.update(self.eos_token_ids)
                for token in sorted(t for t in banned if t < self.vocab_size):
                    rows.append(i)
                    tokens.append(token)
                    values.append(float("-inf"))
        if dense:
            batch.bias_rows = host_to_device(torch.tensor(dense), self.device)
            batch.bias = torch.stack([states[i].bias.row for i in dense])
        if not rows and not sparse:
            return
        edits = host_to_device(torch.tensor([rows, tokens], dtype=torch.int64), self.device)
        edit_values = host_to_device(torch.tensor(values, dtype=torch.float32), self.device)
        if not sparse:
            batch.edit_rows, batch.edit_tokens, batch.edit_values = *edits, edit_values
            return
        biases = [states[i].bias for i in sparse]
        counts = torch.tensor([len(b.ids) for b in biases])
        bias_rows = torch.repeat_interleave(torch.tensor(sparse), counts)
        batch.edit_rows = torch.cat([host_to_device(bias_rows, self.device), edits[0]])
        batch.edit_tokens = torch.cat([*(b.ids for b in biases), edits[1]])
        batch.edit_values = torch.cat([*(b.values for b in biases), edit_values])

    def _add_grammar(self, batch: SamplingBatch, states: list[SeqSampling]) -> None:
        # A matcher that took its stop token last step (a step planned ahead of that result
        # draws once more for it, and the scheduler drops that token) has no next mask.
        rows = [
            i
            for i, s in enumerate(states)
            if s.matcher is not None and not s.matcher.is_terminated()
        ]
        if not rows:
            return
        import xgrammar

        bitmask = xgrammar.allocate_token_bitmask(len(states), self.vocab_size)
        for i in rows:
            states[i].matcher.fill_next_token_bitmask(bitmask, i)
        # Through pinned memory: a pageable upload would wait for the step in flight.
        batch.grammar_bitmask = host_to_device(bitmask, self.device)
        batch.grammar_rows = rows

    @property
    def deferred_matchers(self) -> bool:
        """Some grammar's last token is still on the device: build() must wait for
        accept_deferred()."""
        return bool(self._deferred_matchers)

    def accept_deferred(self, sampled: dict[int, int]) -> None:
        """Feed the deferred matchers their last tokens (seq_id -> token, from the step that
        sampled them)."""
        for seq_id in self._deferred_matchers:
            matcher = self.seqs[seq_id].matcher
            if not matcher.is_terminated():  # else: a token drawn past its end, dropped
                matcher.accept_token(sampled[seq_id])
        self._deferred_matchers = []

    def count_device_outputs(self, input_ids: torch.Tensor, seqs: list[ScheduledSeq]) -> None:
        """Count the outputs observed as PENDING_TOKEN from the step's inputs, on the device:
        input_ids [num_tokens] int64 with the pending ones filled in, seqs the plan's entries
        in the same order (a pending token is its entry's only input)."""
        if not self._device_outputs:
            return
        starts = itertools.accumulate((len(s.token_ids) for s in seqs), initial=0)
        row_of = {s.seq_id: row for s, row in zip(seqs, starts)}
        slots = [slot for slot, _ in self._device_outputs]
        rows = [row_of[seq_id] for _, seq_id in self._device_outputs]
        self._device_outputs = []
        both = host_to_device(int64_tensor([slots, rows]), self.device)
        self.penalties.record_on_device(both[0], input_ids[both[1]])

    def results(self, draws: list[Draw], output: SamplerOutput) -> list[SampledToken]:
        """Copy the step's draws to the host and wait for them, as records."""
        copy = start_copy(output)
        if output.token_ids.device.type == "cuda":
            torch.cuda.current_stream(output.token_ids.device).synchronize()
        return self.records(draws, copy)

    def records(
        self,
        draws: list[Draw],
        copy: HostCopy,
        params: list[SamplingParams] | None = None,
        seq_ids: list[int] | None = None,  # [len(draws)] each draw's seq_id, if at hand
    ) -> list[SampledToken]:
        """The draws as records; the caller has waited for the copy to land (the executor, on
        the step's last timer mark). params: each draw's parameters as they were at launch (its
        sequence may be forgotten since); needed only with logprobs."""
        host = copy.host
        token_ids = host[0].tolist()
        if copy.output.logprobs is None:  # no row asked for logprobs
            if seq_ids is None:
                seq_ids = [d.seq_id for d in draws]
            return list(map(SampledToken, seq_ids, token_ids))
        if params is None:
            params = [self.seqs[d.seq_id].params for d in draws]
        chosen = host[1].tolist()
        top_ids = host[2].tolist() if copy.output.top_ids is not None else None
        top_values = host[3].tolist() if copy.output.top_ids is not None else None
        tokens = []
        for i, draw in enumerate(draws):
            p = params[i]
            token = SampledToken(draw.seq_id, token_ids[i])
            if p.wants_logprob:
                token.logprob = chosen[i]
                k = p.num_top_logprobs(self.eos_token_ids)
                if k and top_ids is not None:
                    token.top_logprobs = list(zip(top_ids[i][:k], top_values[i][:k]))
            tokens.append(token)
        return tokens


def _plain(state: SeqSampling) -> bool:
    return state.penalty_slot is None and state.matcher is None and state.prompt_len is not None


@dataclass
class HostCopy:
    """A step's sampled ids (and logprobs) on their way to the host: on a GPU the copies are
    queued behind the step, and whoever waits for them waits on an event recorded after them
    (not on the stream, which may hold the next step by then)."""

    output: SamplerOutput
    host: list[torch.Tensor]  # pinned on a GPU; valid once the copies have run


def start_copy(output: SamplerOutput) -> HostCopy:
    tensors = [output.token_ids, output.logprobs, output.top_ids, output.top_logprobs]
    tensors = [t for t in tensors if t is not None]
    if tensors[0].device.type != "cuda":
        return HostCopy(output, [t.cpu() for t in tensors])
    return HostCopy(output, [t.to("cpu", non_blocking=True) for t in tensors])  # pinned

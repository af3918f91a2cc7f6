"""The draft model's proposals: fills a plan's DRAFT_TOKEN slots with K autoregressive draft
steps, its KV in a pool that the target's block tables address directly.

Draft KV is only ever a cache: a sequence whose draft KV may be stale (new, its table replaced
after swap-in, copy-on-write or recompute, or past what verification kept) recomputes it from
the tokens it has seen, so the draft pool needs no swap space and no bookkeeping of its own in
the scheduler. Proposals never decide an output token: verification is exact whatever the
draft proposes, so a stale draft KV could only lower the acceptance rate, never change a token.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from services.executor.block_tables import DeviceBlockTables
from services.executor.draft_sampling import choose, draft_rows, draft_stream_key
from services.executor.input_batch import build_inputs
from services.executor.kv_cache import KVCache
from services.executor.models.decoder import DecoderForCausalLM
from services.executor.sampling_state import SamplingStates
from shared.protocol import DRAFT_TOKEN, ScheduledSeq


@dataclass
class _DraftSeq:
    blocks: list[int] = field(default_factory=list)  # its block table, as the executor holds it
    num_computed: int = 0  # positions 0 .. num_computed - 1 hold valid draft KV


UNKNOWN = -3  # a slot no plan has written since this executor started


class DraftProposer:
    """Rank 0's draft model with its KV pool; the executor calls fill() before each forward
    pass and accepted() after verification.

    It learns tokens from the plans, as the target's KV holds them: the token id of every slot
    of every block (moved with the plan's swaps and copies). So a sequence's history is what
    its block table addresses, also for prefix-cache hits and forks, whose shared blocks other
    sequences' plans wrote."""

    def __init__(
        self,
        model: DecoderForCausalLM,
        cache: KVCache,  # the draft's pool: as many blocks as the target's, no swap space
        block_tables: DeviceBlockTables,  # the executor's (target) tables: the same block ids
        sampling: SamplingStates,  # the target's per-sequence parameters and seeds
        num_cpu_blocks: int,  # the target's swap pool
        reference_views: bool,  # the torch reference attention (build_inputs' argument)
    ) -> None:
        self.model = model
        self.cache = cache
        self.block_size = cache.block_size
        self.block_tables = block_tables
        self.sampling = sampling
        self.reference_views = reference_views
        self.vocab_size = model.spec.vocab_size
        self._seqs: dict[int, _DraftSeq] = {}
        # The token id in each slot of each block of the target's pools.
        self._device_tokens = [[UNKNOWN] * self.block_size for _ in range(cache.num_device_blocks)]
        self._cpu_tokens = [[UNKNOWN] * self.block_size for _ in range(num_cpu_blocks)]

    def apply(
        self,
        swap_out: list[tuple[int, int]],  # (device_block, cpu_block)
        swap_in: list[tuple[int, int]],  # (cpu_block, device_block)
        copies: list[tuple[int, int]],  # (src, dst) device blocks
    ) -> None:
        """The plan's block moves, in its order: the token map follows all of them, the draft
        pool only the copies (a swapped sequence's table is replaced, its draft KV recomputed)."""
        for device_block, cpu_block in swap_out:
            self._cpu_tokens[cpu_block] = list(self._device_tokens[device_block])
        if swap_out:
            # Its blocks go to others meanwhile, and swap-in may hand it the same ids again:
            # a swapped-out sequence's draft KV is recomputed whatever its next table says.
            moved = {device_block for device_block, _ in swap_out}
            for state in self._seqs.values():
                if not moved.isdisjoint(state.blocks):
                    state.blocks, state.num_computed = [], 0
        for cpu_block, device_block in swap_in:
            self._device_tokens[device_block] = list(self._cpu_tokens[cpu_block])
        for src, dst in copies:
            self._device_tokens[dst] = list(self._device_tokens[src])
        self.cache.apply([], [], copies)

    def forget(self, seq_ids: list[int]) -> None:
        for seq_id in seq_ids:
            self._seqs.pop(seq_id, None)

    def accepted(self, seq_id: int, num_valid_positions: int) -> None:
        """Verification kept positions 0 .. num_valid_positions - 1 of the sequence."""
        state = self._seqs.get(seq_id)
        if state is not None:
            state.num_computed = min(state.num_computed, num_valid_positions)

    def fill(self, seqs: list[ScheduledSeq]) -> dict[int, torch.Tensor | None]:
        """Learn every planned sequence's tokens and table (call it for every plan, after the
        executor's table updates), then replace the DRAFT_TOKEN slots of speculating ones in
        place. Returns, per speculating seq_id, the draft distribution [K, vocab] fp32 each
        proposal was drawn from, or None where proposals are deterministic (greedy)."""
        speculating = []
        for seq in seqs:
            self._observe(seq)
            if seq.num_spec_tokens and seq.token_ids[-1] == DRAFT_TOKEN:
                speculating.append(seq)
        if not speculating:
            return {}
        probs: dict[int, torch.Tensor | None] = {}
        runnable = []
        for seq in speculating:
            first = len(seq.token_ids) - seq.num_spec_tokens
            state = self._seqs[seq.seq_id]
            history = self._tokens(state, state.num_computed, seq.start_pos + first)
            if UNKNOWN not in history:
                runnable.append(seq)
                continue
            # Nothing to condition on: any deterministic proposal is verified exactly.
            seq.token_ids[first:] = [seq.token_ids[first - 1]] * seq.num_spec_tokens
            self._record(state, seq.start_pos, seq.token_ids)
            probs[seq.seq_id] = None
        if runnable:
            with torch.inference_mode():
                probs.update(self._propose(runnable))
        return probs

    def _observe(self, seq: ScheduledSeq) -> None:
        state = self._seqs.setdefault(seq.seq_id, _DraftSeq())
        if seq.replace_table:
            # Draft KV stays valid in the leading blocks the new table keeps (a table trimmed
            # after rejected proposals); from the first block that changed on, it is not.
            same = 0
            for old, new in zip(state.blocks, seq.block_ids):
                if old != new:
                    break
                same += 1
            state.num_computed = min(state.num_computed, same * self.block_size)
            state.blocks = list(seq.block_ids)
        else:
            state.blocks.extend(seq.block_ids)
        # Positions from start_pos on are (re)written by this step: draft KV there is stale.
        state.num_computed = min(state.num_computed, seq.start_pos)
        real = seq.token_ids[: len(seq.token_ids) - seq.num_spec_tokens]
        self._record(state, seq.start_pos, real)

    def _record(self, state: _DraftSeq, start_pos: int, token_ids: list[int]) -> None:
        size = self.block_size
        for pos, token in enumerate(token_ids, start=start_pos):
            # A negative id (PENDING_TOKEN) is a value only the device holds yet.
            self._device_tokens[state.blocks[pos // size]][pos % size] = (
                token if token >= 0 else UNKNOWN
            )

    def _tokens(self, state: _DraftSeq, start: int, end: int) -> list[int]:
        size = self.block_size
        return [self._device_tokens[state.blocks[p // size]][p % size] for p in range(start, end)]

    def _propose(self, seqs: list[ScheduledSeq]) -> dict[int, torch.Tensor | None]:
        """Draft step j feeds each sequence's next input (step 0: every token its draft KV
        lacks, through the last real one; then its previous proposal) and proposes slot j."""
        states = [self._seqs[s.seq_id] for s in seqs]
        firsts = [len(s.token_ids) - s.num_spec_tokens for s in seqs]  # first slot's index
        params = [self.sampling.seqs[s.seq_id] for s in seqs]
        stream_keys = [draft_stream_key(p.key) for p in params]
        drawn: dict[int, list[torch.Tensor]] = {s.seq_id: [] for s in seqs}
        sampled: dict[int, bool] = {s.seq_id: not p.params.greedy for s, p in zip(seqs, params)}
        for step in range(max(s.num_spec_tokens for s in seqs)):
            rows = [i for i, s in enumerate(seqs) if s.num_spec_tokens > step]
            planned = []
            positions = []
            for i in rows:
                seq, state = seqs[i], states[i]
                slot_pos = seq.start_pos + firsts[i] + step  # position of the proposal
                start = min(state.num_computed, slot_pos - 1)
                history = self._tokens(state, start, slot_pos)
                planned.append(ScheduledSeq(seq.seq_id, history, start, [], False, sample=True))
                positions.append(slot_pos)
            logits = self._forward(planned)  # [len(rows), vocab]
            choice = draft_rows(
                [params[i].params for i in rows],
                [stream_keys[i] for i in rows],
                positions,
                self.vocab_size,
                logits.device,
            )
            token_ids, dist = choose(logits, choice)
            for row, (i, token) in enumerate(zip(rows, token_ids.tolist())):
                seq, state = seqs[i], states[i]
                state.num_computed = positions[row]
                seq.token_ids[firsts[i] + step] = token
                self._record(state, positions[row], [token])
                if dist is not None and sampled[seq.seq_id]:
                    drawn[seq.seq_id].append(dist[row])
        return {s.seq_id: torch.stack(drawn[s.seq_id]) if sampled[s.seq_id] else None for s in seqs}

    def _forward(self, planned: list[ScheduledSeq]) -> torch.Tensor:
        """The draft model over the planned tokens: logits [len(planned), vocab] fp32 of each
        sequence's last token. Its KV goes to the draft pool through the target's tables."""
        table = self.block_tables.rows([s.seq_id for s in planned])
        inputs = build_inputs(planned, table, self.cache.block_size, self.reference_views)
        hidden = self.model(inputs.input_ids, inputs.positions, self.cache.device, inputs.attention)
        return self.model.compute_logits(hidden[inputs.logits_rows])

"""The executor: owns the model, the KV pools and per-sequence sampling state; runs one plan a step.

It decides nothing about blocks: every block id, copy and swap comes from the plan.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import time
import traceback
from pathlib import Path

import torch

from kernels.cpu_rows import load_row_ops
from kernels.metadata import host_to_device, int64_tensor
from kernels.ops import select_ops
from services.executor.block_tables import DeviceBlockTables
from services.executor.context_mirror import ContextMirrors
from services.executor.cuda_graphs import DecodeGraphs
from services.executor.draft_kv import shared_pool_configs
from services.executor.draft_model import load_draft_model
from services.executor.draft_proposer import DraftProposer
from services.executor.grammar import GrammarStore
from services.executor.input_batch import build_inputs
from services.executor.kv_cache import KVCache
from services.executor.layer_parts import LayerParts, num_trailing_parts
from services.executor.model_setup import (
    eos_token_ids,
    max_model_len,
    model_dtype,
    pick_device,
    sampling_defaults,
)
from services.executor.models import model_spec
from services.executor.phase_timer import PhaseTimer
from services.executor.prompt_logprobs import prompt_rows, score_prompt
from services.executor.quantize_model import (
    calibration_token_ids,
    quantize_model,
    resolve_quantization,
)
from services.executor.quantized import Int4Linear, Int8Linear
from services.executor.rank_group import RankGroup
from services.executor.sampler import sample
from services.executor.sampling_state import Draw, SamplingStates, start_copy
from services.executor.spec_verify import verify
from services.executor.step_in_flight import SpecRows, StepInFlight
from services.executor.tensor_parallel import check_divisible
from services.executor.weights import load_hf_config, load_model
from shared.config import EngineConfig
from shared.errors import InvalidRequestError
from shared.model_source import source_gguf
from shared.protocol import (
    DRAFT_TOKEN,
    PENDING_TOKEN,
    CompileGrammar,
    ExecutorReady,
    GrammarCompiled,
    SampledToken,
    ScheduledSeq,
    StepPlan,
    StepResult,
)

log = logging.getLogger("pagedserve.executor")


# How many times faster than fp32 a quantization mode's linear layers run on the CPU
# (`_int_mm` 5.4x at 64 rows, docs/benchmarks.md "cpu_linear_kernels"). Attention stays fp32,
# so with int8 weights a context token costs that many times more of a chunk token's linear
# work than the multiply-adds say (ModelSpec.context_cost_tokens counts them as fp32).
LINEAR_SPEEDUP = {"int8": 5}
# A chunk's read of its cached context, in rows of its attention: 7.35 fitted for the reference
# attention on SmolLM2 (benchmarks/deep_chunk_attention.py, 2 threads). Reported to the scheduler
# (ExecutorReady.context_read_rows), which plans deep chunks in layer parts by it.
CONTEXT_READ_ROWS = 7.35


class Executor:
    """Rank 0 (the default) talks to the scheduler; with tensor parallelism it starts or meets
    ranks 1.. (`tp_worker`), broadcasts each plan to them, and alone samples and answers."""

    def __init__(self, config: EngineConfig, model_dir: Path, rank: int = 0) -> None:
        if config.model.num_threads:
            torch.set_num_threads(config.model.num_threads)
        elif rank > 0 and config.model.device != "cuda":
            # CPU ranks on one machine share its cores: each takes its share, not all of them.
            size = config.parallel.tensor_parallel_size
            torch.set_num_threads(max(1, torch.get_num_threads() // size))
        self.device = pick_device(config.model.device, rank)
        self.ops = select_ops(config.model.attention_backend, self.device)
        block_size = config.cache.block_size
        if self.ops.name == "triton" and block_size & (block_size - 1):
            raise ValueError(f"the triton kernels need a power-of-two block size, got {block_size}")
        hf_config = load_hf_config(model_dir)
        size = config.parallel.tensor_parallel_size
        # Refused before any rank starts: a bad split must fail here, not hang a collective.
        check_divisible(model_spec(hf_config), size)
        external = config.parallel.external_workers
        if self.device.type == "cuda" and not external and size > torch.cuda.device_count():
            raise ValueError(
                f"tensor-parallel size {size} exceeds the {torch.cuda.device_count()} CUDA devices"
            )
        self.ranks = RankGroup(config, rank, self.device)
        self.shard = self.ranks.shard
        self.max_model_len = max_model_len(hf_config, config.model.max_model_len)
        dtype = model_dtype(config.model.dtype, hf_config, self.device)
        self.model = load_model(
            model_dir, dtype, self.max_model_len, self.ops, self.device, self.shard
        )
        self.quantization = resolve_quantization(
            config.model.quantization, model_dir, self.device, config.model.cpu_row_kernels
        )
        refusal = type(self.model).quantization_refusal
        if self.quantization != "none" and refusal:
            raise ValueError(f"--quantization {self.quantization}: {refusal}")
        # Only int4 repacks the file's own Q4_1 blocks; int8 quantizes the fp32 weights (the
        # embedding's int8 rows then equal the file's Q8_0 blocks, see
        # tests/engine/test_quantized.py).
        gguf_path = source_gguf(model_dir) if self.quantization == "int4" else None
        calibration_ids = (
            calibration_token_ids(model_dir, self.max_model_len)
            if self.quantization != "none"
            else None
        )
        quantize_model(
            self.model,
            self.quantization,
            gguf_path,
            calibration_ids,
            model_dir,
            decode_kernel=config.model.int8_decode_kernel,
        )
        # This rank's KV heads of every block: one block table serves every rank.
        cache_config = config.cache
        draft_model = None
        if config.speculative.method == "draft":
            draft_model = load_draft_model(
                config, self.model, model_dir, self.max_model_len, dtype, self.quantization,
                self.ops, self.device,
            )  # fmt: skip
            # One block count for both pools, within the one KV budget (draft_kv.py).
            cache_config, draft_cache_config = shared_pool_configs(
                config.cache, self.model.kv_layout, draft_model.kv_layout, dtype
            )
        if self.device.type == "cpu" and self.ops.name == "torch":
            self._use_row_kernels(config.model.cpu_row_kernels, self.model, draft_model)
        self.cache = KVCache(self.model.kv_layout, cache_config, dtype, self.device, self.ops)
        self.mirrors = self._context_mirrors(config.cache.context_mirror_bytes)
        self.eos_token_ids = eos_token_ids(model_dir, hf_config)
        auto = config.model.generation_config == "auto"
        self.default_sampling = sampling_defaults(model_dir) if auto else {}
        self.model_dir = model_dir
        self.block_tables = DeviceBlockTables(-(-self.max_model_len // block_size), self.device)
        # Rank 0 only makes matchers; grammars reach it compiled (grammar_compiles.py).
        self.grammars = GrammarStore(
            model_dir, self.model.spec.vocab_size, self.eos_token_ids, config.grammar.cache_bytes
        )
        # The store's own method, not one of this executor's: a bound method of the executor
        # would make a cycle that holds the KV pool after `del` until a collection runs.
        self.sampling = SamplingStates(
            self.model.spec.vocab_size,
            self.eos_token_ids,
            self.device,
            config.model.seed,
            self.grammars.matcher,
        )
        self._last_sampled: dict[int, int] = {}  # seq_id -> its last sampled token (rank 0)
        self._freed_since_collect: list[int] = []  # not to be put back by a step in flight
        self._latest: StepInFlight | None = None  # the last launched step, until collected
        # Read by the grammar compile thread, which runs a compile in slices while steps run.
        self.num_launched = 0
        # --speculative-method draft: fills DRAFT_TOKEN slots before the forward pass
        # (fill(seqs) -> {seq_id: draft_probs [K, vocab]} or None) and learns how much of its
        # own KV stays valid after verification (accepted(seq_id, num_valid_positions)).
        self.draft: DraftProposer | None = None
        if draft_model is not None:
            draft_cache = KVCache(
                draft_model.kv_layout, draft_cache_config, dtype, self.device, self.ops
            )
            self.draft = DraftProposer(
                draft_model,
                draft_cache,
                self.block_tables,
                self.sampling,
                self.cache.num_cpu_blocks,
                reference_views=self.ops.name == "torch",
            )
        # Deep prompt chunks in layer parts (layer_parts.py): the reference attention's cost,
        # on one rank (each would need the parts' states) and without a draft model (which
        # learns tokens from every plan entry).
        self.parts: LayerParts | None = None
        if self.ops.name == "torch" and self.shard.size == 1 and self.draft is None:
            self.parts = LayerParts(self.model)
        self._warm_up_kernels()
        self.graphs = self._capture_graphs(config)

    def _warm_up_kernels(self) -> None:
        """On a GPU with the Triton kernels, compile each attention and sampling variant now,
        not in the middle of a served step (kernels/triton_warmup.py, triton_sampling.py)."""
        if self.device.type != "cuda" or self.ops.name != "triton":
            return
        from kernels.triton_warmup import warm_up_attention

        spec = self.model.spec
        pool = self.cache.device  # [num_layers, 2, num_blocks, block_size, kv_heads, head_dim]
        heads = spec.num_heads // self.shard.size
        warm_up_attention(
            pool[0, 0], pool[0, 1], heads, spec.softmax_scale, spec.attn_softcap, spec.windows
        )
        if self.shard.is_driver:  # only rank 0 samples, over the whole vocabulary
            from kernels.triton_sampling import warm_up_sampling

            warm_up_sampling(spec.vocab_size, self.device)

    def _capture_graphs(self, config: EngineConfig) -> DecodeGraphs | None:
        """CUDA graphs for decode steps, where they apply: a CUDA device, the Triton kernels, one
        rank (collectives are not captured here) and no --enforce-eager. A failed capture is
        logged and the executor runs eagerly: graphs are an optimisation, never a requirement."""
        if (
            config.model.enforce_eager
            or self.device.type != "cuda"
            or self.ops.name != "triton"
            or self.shard.size > 1
            or self.quantization != "none"
        ):
            return None
        try:
            return DecodeGraphs(
                self.model,
                self.cache.device,
                self.cache.block_size,
                self.block_tables.max_blocks,
                config.scheduler.max_num_seqs,
            )
        except Exception:  # noqa: BLE001 - any failure means: run eagerly
            log.exception("CUDA graph capture failed; decode steps run eagerly")
            return None

    @staticmethod
    def _use_row_kernels(setting: str, *models) -> None:
        """The CPU row kernels for the models built of layers they implement (built here on
        a first start: seconds; kernels/cpu_rows.py)."""
        if setting == "off":
            return
        row_ops = load_row_ops()
        for model in models:
            if model is None:
                continue
            if model.use_row_kernels(row_ops):
                log.info("CPU row kernels serve %s's decode and verify steps", type(model).__name__)
            for module in model.modules():  # their int8 and 4-bit linears, fbgemm's guards
                if isinstance(module, (Int8Linear, Int4Linear)):
                    module.use_row_ops(row_ops)

    def _context_mirrors(self, budget_bytes: int) -> ContextMirrors | None:
        """Mirrors of deep prompt chunks' context, where they apply: the reference attention
        (a GPU's kernels read the blocks in place) on its plain path (no soft-capping, no
        window, which gather differently) and a budget above 0."""
        spec = self.model.spec
        if budget_bytes <= 0 or self.ops.name != "torch" or spec.attn_softcap or any(spec.windows):
            return None
        return ContextMirrors(self.cache.device, budget_bytes, self.max_model_len)

    # ---- tensor parallelism -----------------------------------------------------------------
    def ranks_alive(self) -> bool:
        """False once the tensor-parallel group cannot go on (see RankGroup.alive)."""
        return self.ranks.alive()

    def follow(self) -> None:
        """Ranks 1..: run each plan rank 0 broadcasts, until it broadcasts the stop."""
        while (plan := self.ranks.next_plan()) is not None:
            # Unlike rank 0, a failure here is not survivable: raised, it ends this rank, which
            # rank 0 sees (a closed connection in its next collective, then ranks_alive()).
            self._execute(plan)
        torch.distributed.destroy_process_group()

    def close(self) -> None:
        """Rank 0: stop the other ranks (idempotent)."""
        self.ranks.close()

    def compile_grammar_now(self, request: CompileGrammar) -> GrammarCompiled:
        """The in-process engine's compile: in this thread, before the request is scheduled
        (no other client waits on it), through the same store as served compiles."""
        try:
            compiled = self.grammars.compile_now((request.kind, request.spec))
        except InvalidRequestError as exc:
            return GrammarCompiled(request.key, exc.message)
        self.grammars.expect(request.key, request.seq_ids)
        self.grammars.hold(request.key, request.seq_ids, compiled)
        return GrammarCompiled(request.key)

    def ready(self) -> ExecutorReady:
        rope_switch = self.model.spec.rope_switch_len
        if rope_switch is not None and self.max_model_len <= rope_switch:
            rope_switch = None  # no sequence outgrows it
        return ExecutorReady(
            num_device_blocks=self.cache.num_device_blocks,
            num_cpu_blocks=self.cache.num_cpu_blocks,
            block_size=self.cache.block_size,
            max_model_len=self.max_model_len,
            vocab_size=self.model.spec.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device_type=self.device.type,
            context_cost_tokens=self.model.spec.context_cost_tokens
            // LINEAR_SPEEDUP.get(self.quantization, 1),
            context_read_rows=CONTEXT_READ_ROWS if self.parts is not None else 0.0,
            num_layers=self.model.spec.num_layers,
            default_sampling=self.default_sampling,
            sliding_window=self.model.spec.shared_window,
            rope_switch_len=rope_switch,
        )

    def execute(self, plan: StepPlan) -> StepResult:
        """Apply the plan; a failure becomes StepResult.error so its requests end, not hang."""
        return self.collect(self.launch(plan))

    def launch(self, plan: StepPlan) -> StepInFlight:
        """Queue the plan's device work and the copy of its samples; return without waiting.

        A plan made ahead (async scheduling) may name inputs that the previous step, still in
        flight, is sampling: they are read from that step's device tensor, so this step is
        queued behind it and the device never waits for the host in between. Never raises: a
        failure is the flight's result."""
        self.num_launched += 1
        try:
            # Before the pending tokens are filled in, which may fail: the scheduler never names
            # the freed ids again, so a failed plan must still release them.
            self._forget(plan.freed_seq_ids)
            seq_ids = [s.seq_id for s in plan.seqs]  # once: both steps below read them
            plan, fills, source = self._resolve_pending(plan, seq_ids)
            if self.shard.size > 1 and self.shard.is_driver:
                if not self.ranks_alive():
                    raise RuntimeError("a tensor-parallel rank has exited")
                self.ranks.send_plan(plan)
            flight = self._launch(plan, fills, source, seq_ids)
        except Exception as exc:  # noqa: BLE001 - reported to the scheduler, which ends requests
            flight = StepInFlight(plan.step_id, result=self._failure(plan.step_id, exc))
        if flight.result is None:
            self._latest = flight
        return flight

    def collect(self, flight: StepInFlight) -> StepResult:
        """Wait for the flight's samples (only they: work queued after it runs on)."""
        if self._latest is flight:
            self._latest = None
        if flight.result is not None:
            return flight.result
        try:
            tokens = []
            flight.timer.wait()  # the step's last mark: after its copy, before the next step
            start = time.perf_counter()  # host work only: the wait above is the device's
            if flight.copy is not None:
                tokens = self.sampling.records(
                    flight.draws, flight.copy, flight.params, flight.draw_seq_ids
                )
            timings = flight.timer.seconds()
            timings["records"] = time.perf_counter() - start
            accepted = 0
            if flight.spec:
                tokens, accepted = self._verified(flight, tokens)
            flight.result = StepResult(flight.step_id, tokens, timings)
            flight.result.num_proposed = sum(len(r.proposals) for r in flight.spec)
            flight.result.num_accepted = accepted
            if flight.prompt is not None:
                flight.result.prompt_logprobs = flight.prompt.records()
            self._last_sampled.update((t.seq_id, t.token_id) for t in tokens)
            # Not for a sequence freed by a plan launched meanwhile: it would stay forever.
            for seq_id in self._freed_since_collect:
                self._last_sampled.pop(seq_id, None)
            self._freed_since_collect = []
        except Exception as exc:  # noqa: BLE001 - as in launch()
            flight.result = self._failure(flight.step_id, exc)
        return flight.result

    def _verified(
        self, flight: StepInFlight, tokens: list[SampledToken]
    ) -> tuple[list[SampledToken], int]:
        """The draws with each speculating sequence's K + 1 draws replaced by what verification
        keeps of them (its accepted proposals, then the corrected or bonus token), and the
        number of proposals accepted."""
        out: list[SampledToken] = []
        at = accepted = 0
        filtered = flight.copy.output.filtered if flight.copy is not None else None
        for rows in flight.spec:
            out.extend(tokens[at : rows.first_draw])
            end = rows.first_draw + len(rows.proposals) + 1
            draws = tokens[rows.first_draw : end]
            span = slice(rows.first_draw, end)
            kept = verify(
                [t.token_id for t in draws],
                rows.proposals,
                rows.draft_probs,
                filtered[span] if filtered is not None else None,
                flight.rng_keys[span] if flight.rng_keys is not None else None,
                rows.greedy,
            )
            for i, token_id in enumerate(kept):
                token = draws[i]
                if token.token_id != token_id:  # a residual draw: its logprob is not the draw's
                    token = SampledToken(rows.seq_id, token_id)
                out.append(token)
            accepted += len(kept) - 1
            if self.draft is not None:
                self.draft.accepted(rows.seq_id, rows.start_pos + len(kept))
            at = end
        out.extend(tokens[at:])
        return out, accepted

    def _prompt_top_k(self, seq_id: int) -> int:
        """Top logprobs per prompt token the sequence asked for (rank 0 alone knows)."""
        if not self.shard.is_driver:
            return 0
        return self.sampling.seqs[seq_id].params.prompt_logprobs or 0

    def _failure(self, step_id: int, exc: Exception) -> StepResult:
        traceback.print_exception(exc)
        if self.mirrors is not None:
            # The step may have stopped between layers: no mirror can be trusted to be whole.
            self.mirrors.clear()
        if self.shard.size > 1:
            # The other ranks may now wait in a collective this rank will never issue: the
            # group is out of step for good. The executor stops (ranks_alive() turns False)
            # and is replaced like any dead executor.
            self.ranks.broken = True
        return StepResult(step_id, [], error=f"{type(exc).__name__}: {exc}")

    def _forget(self, seq_ids: list[int]) -> None:
        """The scheduler freed these sequences: drop their tables and (rank 0) their state."""
        for seq_id in seq_ids:
            self.block_tables.forget(seq_id)
            if self.mirrors is not None:
                self.mirrors.forget(seq_id)
            if self.parts is not None:
                self.parts.forget(seq_id)
            if self.shard.is_driver:
                self.sampling.forget(seq_id)
                if self.draft is not None:
                    self.draft.forget([seq_id])
                self.grammars.forget(seq_id)
                self._last_sampled.pop(seq_id, None)
                self._freed_since_collect.append(seq_id)

    def _resolve_pending(
        self,
        plan: StepPlan,
        seq_ids: list[int],  # [len(plan.seqs)] each entry's seq_id
    ) -> tuple[StepPlan, list[tuple[int, int]], torch.Tensor | None]:
        """A plan made while the previous step ran names its decode inputs PENDING_TOKEN: the
        token this executor sampled for that sequence in the previous step. Where that step is
        still in flight, the entries stay as they are and the second value says which input
        rows to copy on the device from its sampled ids (the third value): (flat input row,
        row of its samples) pairs, or ALL_INPUTS. Tokens already on the host are filled into a
        copy of the plan. The caller's plan is left as it was sent."""
        seqs = plan.seqs
        prev = self._latest
        if (
            prev is not None
            and prev.draw_seq_ids is not None
            and self.shard.size == 1
            and self.draft is None
            and all(s.token_ids == _PENDING for s in seqs)
            and prev.draw_seq_ids == seq_ids
        ):
            # Most decode steps: the step in flight's sequences in its order, each decoding
            # the token it is sampling, so its sampled ids are this step's inputs as they stand
            # (what the general path below finds too, in a few more passes over the plan).
            return plan, ALL_INPUTS, prev.device_tokens
        # A pending token is always a decode's only input: no scan of long prompt chunks.
        pending = [i for i, s in enumerate(seqs) if s.token_ids[-1:] == _PENDING]
        if not pending:
            return plan, [], None
        on_device: list[int] = []
        if prev is not None:
            on_device = [i for i in pending if seqs[i].seq_id in prev.rows]
            # The other ranks of a tensor-parallel group get the plan with its tokens, and
            # the draft model learns every token from the plans, on the host: those wait for
            # the copy. (Penalty counts take the tokens on the device; a grammar's matcher
            # waits for them after the forward pass is queued: see _launch.)
            if on_device and (self.shard.size > 1 or self.draft is not None):
                self.collect(prev)  # its result waits in the flight for its own collect()
                on_device = []
        for i in pending:
            if len(seqs[i].token_ids) != 1:
                raise ValueError(f"sequence {seqs[i].seq_id}: a pending input beside others")
        fills = []
        if on_device:
            # Each sequence's first row in the flat batch, for the device copies; these entries
            # keep PENDING_TOKEN as their token on the host (overwritten on the device before the
            # forward pass), so most steps copy no entry of the plan.
            if len(pending) == len(seqs):  # a decode-only plan: row i is sequence i
                flat = range(len(seqs))
            else:
                flat = list(itertools.accumulate((len(s.token_ids) for s in seqs), initial=0))
            rows = prev.rows
            sources = [rows[seqs[i].seq_id] for i in on_device]
            if len(sources) == len(prev.draws) == len(seqs) and sources == list(flat):
                # The same sequences in the same order as the step before (most decode
                # steps): its sampled ids are this step's inputs as they stand.
                fills = ALL_INPUTS
            else:
                fills = [(flat[i], row) for i, row in zip(on_device, sources)]
        if len(on_device) == len(pending):
            host = []
        else:
            host = [i for i in pending if not on_device or seqs[i].seq_id not in prev.rows]
        if host:
            seqs = list(seqs)
            for i in host:
                seq = seqs[i]
                if seq.seq_id not in self._last_sampled:
                    raise ValueError(f"sequence {seq.seq_id}: no sampled token for its input")
                seqs[i] = dataclasses.replace(seq, token_ids=[self._last_sampled[seq.seq_id]])
            plan = dataclasses.replace(plan, seqs=seqs)
        source = prev.device_tokens if fills else None
        return plan, fills, source

    def _accept_in_flight(self) -> None:
        """Wait for the step in flight (the one launched before this) and feed its tokens to
        the grammars that were given them as PENDING_TOKEN."""
        if self._latest is None:
            raise RuntimeError("a grammar's last token: no step in flight sampled it")
        result = self.collect(self._latest)  # kept in the flight for the engine's collect()
        if result.error is not None:
            raise RuntimeError(f"the step that sampled a grammar's token failed: {result.error}")
        self.sampling.accept_deferred({t.seq_id: t.token_id for t in result.tokens})

    def _execute(self, plan: StepPlan) -> StepResult:
        """Ranks 1..: one plan, start to end."""
        self._forget(plan.freed_seq_ids)  # rank 0 does it in launch()
        return self.collect(self._launch(plan, [], None))

    def _launch(
        self,
        plan: StepPlan,
        fills: list[tuple[int, int]],  # (flat input row, row of source), or ALL_INPUTS
        source: torch.Tensor | None,  # [previous step's draws] int64 sampled ids on the device
        seq_ids: list[int] | None = None,  # [len(plan.seqs)] each entry's seq_id, if at hand
    ) -> StepInFlight:
        timer = PhaseTimer(self.device)
        driver = self.shard.is_driver  # only rank 0 keeps sampling state, samples and answers
        self.cache.apply(plan.swap_out, plan.swap_in, plan.copies)
        if self.draft is not None and driver:
            self.draft.apply(plan.swap_out, plan.swap_in, plan.copies)
        tables, known = self.block_tables, self.block_tables.slots
        for seq in plan.seqs:
            new = seq.seq_id not in known
            if new:
                if seq.sampling is None:
                    raise ValueError(
                        f"plan schedules unknown sequence {seq.seq_id} without sampling"
                    )
                if driver:
                    self.sampling.add(seq.seq_id, seq.sampling, seq.sample_index, seq.prompt_len)
            if new or seq.block_ids or seq.replace_table:  # most decodes: the table stands
                tables.update(seq.seq_id, seq.block_ids, seq.replace_table)
        if driver:
            self.sampling.observe_plan(plan.seqs)
        timer.mark("cache_ops")
        if not plan.seqs:  # cache moves only: collect() reads the timer once they are done
            timer.mark("sync_out")
            return StepInFlight(plan.step_id, timer=timer)

        draft_probs = {}
        if self.draft is not None and driver:
            # Every plan, so that the draft learns each sequence's tokens and table; filled
            # slots go into copies of the scheduler's token lists.
            if _has_draft_slots(plan):
                plan = dataclasses.replace(plan, seqs=[_own_tokens(s) for s in plan.seqs])
            # Tensor parallelism with a draft model is not supported: only rank 0 fills.
            draft_probs = self.draft.fill(plan.seqs) or {}
        if seq_ids is None:
            seq_ids = [s.seq_id for s in plan.seqs]
        tables = self.block_tables.rows(seq_ids)
        # Deep chunks' layer parts (last in the plan) run on their own after the batch.
        num_parts = num_trailing_parts(plan.seqs) if self.parts is not None else 0
        if self.parts is None and plan.seqs and plan.seqs[-1].layers is not None:
            raise ValueError("layer parts need the reference backend on one rank")
        batch_seqs = plan.seqs[: len(plan.seqs) - num_parts] if num_parts else plan.seqs
        # Asked once for the mirrors and the inputs: most steps are one sampled token each.
        decodes = not num_parts and all(
            len(s.token_ids) == 1 and s.sample and s.rope_len is None for s in plan.seqs
        )
        mirrors = (
            None if self.mirrors is None else self.mirrors.for_step(plan.seqs, tables, decodes)
        )
        inputs = build_inputs(
            batch_seqs,
            tables[: len(batch_seqs)],
            self.cache.block_size,
            reference_views=self.ops.name == "torch",
            mirrors=None if mirrors is None else mirrors[: len(batch_seqs)],
            ids_on_device=fills is ALL_INPUTS,
            one_token_each=decodes,
        )
        draws = []
        draw_seq_ids = None  # [len(draws)] when each draw is its own sequence's only one
        spec: list[SpecRows] = []
        sampling_seqs = [seq for seq in plan.seqs if seq.sample]
        row = 0  # logits row of the sequence's (first) draw
        # Most steps: one draw per sampling sequence, on its own logits row, and no loop below.
        one_each = not any(s.fork_seq_ids or s.num_spec_tokens for s in sampling_seqs)
        if one_each and driver:
            all_sample = len(sampling_seqs) == len(plan.seqs)
            draw_seq_ids = seq_ids if all_sample else [s.seq_id for s in sampling_seqs]
            draws = list(map(Draw, range(len(draw_seq_ids)), draw_seq_ids))
        for seq in [] if one_each else sampling_seqs:
            for index, child_id in enumerate(seq.fork_seq_ids, start=1):
                # Known from now on; its first plan entry carries its whole table.
                self.block_tables.register(child_id)
                if driver:
                    self.sampling.fork(seq.seq_id, child_id, index)
            k = seq.num_spec_tokens
            if driver and k:
                # One draw per verified position, each keyed as that token's plain draw.
                params = self.sampling.seqs[seq.seq_id].params
                proposals = seq.token_ids[-k:]
                spec.append(
                    SpecRows(
                        seq.seq_id,
                        len(draws),
                        seq.start_pos,
                        proposals,
                        params.greedy,
                        draft_probs.get(seq.seq_id),
                    )
                )
                draws.extend(Draw(row + i, seq.seq_id, offset=i) for i in range(k + 1))
            elif driver:
                draws.append(Draw(row, seq.seq_id))
                draws.extend(Draw(row, child_id) for child_id in seq.fork_seq_ids)
            row += k + 1
        # Inputs the previous step is still sampling: read from its device tensor.
        if fills is ALL_INPUTS:
            inputs.input_ids.copy_(source)
        elif fills:
            at, rows = host_to_device(int64_tensor(fills).T, self.device)
            inputs.input_ids[at] = source[rows]
        if driver:  # penalty counts of those inputs, on the device too, before the draws
            self.sampling.count_device_outputs(inputs.input_ids, batch_seqs)
        # A grammar whose last token is still being sampled by the step in flight: the
        # bitmask waits for it, after this step's forward pass is queued behind that step.
        deferred = driver and self.sampling.deferred_matchers
        batch = self.sampling.build(draws) if draws and not deferred else None
        timer.mark("prepare")
        with torch.inference_mode():
            decode_only = inputs.attention.max_query_len == 1 and len(sampling_seqs) == len(
                plan.seqs
            )
            if self.graphs is not None and decode_only and self.graphs.bucket(len(plan.seqs)):
                hidden = self.graphs.run(inputs.input_ids, inputs.attention)
            elif batch_seqs:
                hidden = self.model(
                    inputs.input_ids, inputs.positions, self.cache.device, inputs.attention
                )
            last = hidden[inputs.logits_rows] if batch_seqs else None  # [rows, hidden]
            if num_parts:  # their sampling rows follow the batch's, as their entries do
                part_rows = self.parts.run(
                    plan.seqs[len(batch_seqs) :],
                    tables[len(batch_seqs) :],
                    None if mirrors is None else mirrors[len(batch_seqs) :],
                    self.cache.device,
                    self.cache.block_size,
                )
                if part_rows:
                    last = torch.cat(([last] if last is not None else []) + part_rows)
            logits = None
            if sampling_seqs:  # every rank: the LM head is split by vocabulary
                logits = self.model.compute_logits(last)  # [rows, vocab]
            rows, targets, spans = prompt_rows(batch_seqs, self._prompt_top_k)
            prompt = None
            if rows:  # every rank, as above; only rank 0 keeps the result
                prompt = score_prompt(hidden, self.model.compute_logits, rows, targets, spans)
            timer.mark("forward")
            if deferred:
                self._accept_in_flight()
                batch = self.sampling.build(draws) if draws else None
            if batch is not None and any(r.draft_probs is not None for r in spec):
                batch.want_filtered = True
            output = sample(logits, batch) if batch is not None else None
        timer.mark("sample")
        flight = StepInFlight(plan.step_id, draws, timer, prompt=prompt if driver else None)
        flight.spec = spec
        if batch is not None and batch.want_filtered:
            flight.rng_keys = batch.rng_keys
        if output is not None:
            # The step's one host synchronisation, waited for in collect(): sampled ids (and
            # asked-for logprobs) only.
            flight.copy = start_copy(output)
            flight.device_tokens = output.token_ids
            flight.draw_seq_ids = draw_seq_ids
            if batch.num_logprobs >= 0:
                flight.params = [self.sampling.seqs[d.seq_id].params for d in draws]
        # The copy is queued (on a CPU, done): the step's device work ends here, whatever runs
        # between now and its collect() (the next step, launched meanwhile) is not its own.
        timer.mark("sync_out")
        return flight


_PENDING = [PENDING_TOKEN]
# fills meaning: input row i is row i of the previous step's sampled ids, for every row.
ALL_INPUTS: list[tuple[int, int]] = [(-1, -1)]


def _own_tokens(seq: ScheduledSeq) -> ScheduledSeq:
    """The entry with a token list of its own where the draft fills slots (an in-process
    scheduler's plan stays as it was sent)."""
    return dataclasses.replace(seq, token_ids=list(seq.token_ids)) if seq.num_spec_tokens else seq


def _has_draft_slots(plan: StepPlan) -> bool:
    """Whether a speculating sequence of the plan carries DRAFT_TOKEN slots to fill."""
    return any(
        s.num_spec_tokens and DRAFT_TOKEN in s.token_ids[-s.num_spec_tokens :] for s in plan.seqs
    )

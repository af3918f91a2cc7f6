"""Deep prompt chunks planned in layer parts: the rule, and the parts' course through plans,
replies, preemption and async scheduling."""

from __future__ import annotations

from dataclasses import replace

from services.scheduler.layer_parts import LayerPart, plan_layer_part
from services.scheduler.lookahead import lookahead_seqs
from services.scheduler.scheduler import Scheduler
from services.scheduler.sequence import Sequence
from shared.protocol import ExecutorReady
from tests.support.scheduler_steps import add, make_scheduler, step

LAYERS = 6
K = 20  # context_cost_tokens: a row at context c costs 1 + c / 20 context-free tokens
READ = 8.0  # the context read, in rows


def parted(cap: int = 8, budget: int = 32, read_rows: float = READ, **kwargs) -> Scheduler:
    scheduler = make_scheduler(
        num_device_blocks=64, max_num_batched_tokens=budget, max_model_len=128, **kwargs
    )
    config = replace(scheduler.config, max_prefill_tokens_per_request=cap)
    ready = ExecutorReady(
        64, 16, 4, 128, 100, (2,), device_type="cpu", context_cost_tokens=K,
        context_read_rows=read_rows, num_layers=LAYERS,
    )  # fmt: skip
    return Scheduler(config, ready)


def between_parts(scheduler: Scheduler) -> Sequence:
    """A stream decodes and a long prompt's chunk is under way, its first part reported."""
    add(scheduler, "s", 3, max_tokens=100)
    step(scheduler)
    seq = add(scheduler, "long", 60, first=20, max_tokens=2).seqs[0]
    while seq.layer_part is None or seq.layer_part.done == 0:
        step(scheduler)
    return seq


def test_the_rule_leaves_shallow_chunks_whole_and_splits_deep_ones():
    # At context 4 the cap's 8 rows cost 8 * 1.2 + a read of 8 * 4 / 20 = 11.2, under two caps
    # of 8: in parts that would be one step of 4 layers and one of 2.
    assert plan_layer_part(4, 50, 32, 8, K, READ, LAYERS) is None
    # At context 20 it is 8: as many rows as the cap (8), costing 8 * 2 + 8 = 24, so each step
    # takes floor(6 * 8 / 24) = 2 of the 6 layers (a third of 24: the cap).
    assert plan_layer_part(20, 50, 32, 8, K, READ, LAYERS) == LayerPart(8, 2)
    # At context 40 (a read of 16, 3 per row) 8 rows cost 40: one layer per step.
    assert plan_layer_part(40, 50, 32, 8, K, READ, LAYERS) == LayerPart(8, 1)
    # Fewer rows where the prompt, or the budget, has fewer left: more layers per step, and
    # none at all where the rows left cost under two caps.
    assert plan_layer_part(20, 3, 32, 8, K, READ, LAYERS) == LayerPart(3, 3)  # 6 + 8 = 14
    assert plan_layer_part(20, 50, 2, 8, K, READ, LAYERS) is None  # 4 + 8 = 12
    # Deep enough that one layer per step must keep each part within the cap: rows shrink to
    # (6 * 8 - 40) / 6 = 1 at context 100 (a row costs 6, the read 40).
    assert plan_layer_part(100, 50, 32, 8, K, READ, LAYERS) == LayerPart(1, 1)
    # No parts without a priced model or a read to spread.
    assert plan_layer_part(40, 50, 32, 8, 0, READ, LAYERS) is None
    assert plan_layer_part(40, 50, 32, 8, K, 0.0, LAYERS) is None


def test_a_deep_chunk_runs_in_parts_last_in_the_plan_and_samples_at_its_last_layer():
    scheduler = parted()
    stream = add(scheduler, "s", 3, max_tokens=100)
    step(scheduler)
    long = add(scheduler, "long", 60, first=20, max_tokens=2)
    seq = long.seqs[0]
    seen = []
    while seq.num_computed_tokens < seq.prompt_len:
        computed = seq.num_computed_tokens
        plan, _ = step(scheduler)
        entry = plan.seqs[-1]
        assert entry.seq_id == seq.seq_id
        assert plan.seqs[0].seq_id == stream.seqs[0].seq_id  # the stream's token every step
        if entry.layers is not None:
            assert all(s.layers is None for s in plan.seqs[:-1])
            assert entry.start_pos == computed  # the same tokens until the last part
            ends_prompt = computed + len(entry.token_ids) == seq.prompt_len
            assert entry.sample == (entry.layers[1] == LAYERS and ends_prompt)
            # Computed, and in the sequence's count, only once the last layer is.
            assert (seq.num_computed_tokens > computed) == (entry.layers[1] == LAYERS)
        seen.append((entry.start_pos, len(entry.token_ids), entry.layers))
    # Whole at context 0 (no read); from context 8 (a read of 3.2 rows, 1.4 per row) in parts
    # of 8 rows: 14.4 in all, 3 layers per step; at 16, 20.8 in all, 2 layers per step.
    assert seen[:6] == [(0, 8, None), (8, 8, (0, 3)), (8, 8, (3, 6)), (16, 8, (0, 2)),
                        (16, 8, (2, 4)), (16, 8, (4, 6))]  # fmt: skip
    assert seq.num_output_tokens == 1  # sampled once, at the prompt's last part


def test_a_part_alone_takes_the_rest_of_its_layers_at_once():
    scheduler = parted()
    seq = between_parts(scheduler)
    done = seq.layer_part.done
    scheduler.abort("s")  # no one waits on the steps any more
    plan, _ = step(scheduler)
    assert plan.seqs[-1].layers == (done, LAYERS)
    assert seq.layer_part is None


def test_preemption_between_parts_starts_the_chunk_again_from_its_first_layer():
    for mode in ("swap", "recompute"):
        scheduler = parted(preemption_mode=mode)
        seq = between_parts(scheduler)
        scheduler._preempt(scheduler.groups["long"], [])
        assert seq.layer_part is None, mode
        while True:
            plan, _ = step(scheduler)
            entry = next((s for s in plan.seqs if s.seq_id == seq.seq_id), None)
            if entry is not None:
                break
        # Back: its chunk starts from layer 0 (or runs whole), never from a stale part.
        assert entry.layers is None or entry.layers[0] == 0, mode


def test_a_part_is_never_taken_for_a_decode_to_plan_ahead():
    scheduler = parted()
    stream = add(scheduler, "s", 3, max_tokens=100)
    step(scheduler)
    step(scheduler)
    plan = scheduler.schedule()
    entries = scheduler.plans.inflight[plan.step_id]
    # The stream's decode may be followed ahead; the same entry as a one-token part (of a
    # prompt's last token, say) may not: its next part needs this step's reply.
    assert lookahead_seqs(entries, scheduler.running, 128) == entries
    entries[0].layers, entries[0].partial = (0, 2), True
    assert lookahead_seqs(entries, scheduler.running, 128) is None
    assert stream.seqs[0].num_computed_tokens + 1 == stream.seqs[0].num_tokens


def test_no_parts_when_turned_off_or_for_prompt_logprobs():
    scheduler = parted(read_rows=0.0)
    add(scheduler, "s", 3, max_tokens=100)
    step(scheduler)
    add(scheduler, "long", 60, first=20, max_tokens=2)
    for _ in range(12):
        plan, _ = step(scheduler)
        assert all(s.layers is None for s in plan.seqs)
    scheduler = parted()
    add(scheduler, "s", 3, max_tokens=100)
    step(scheduler)
    add(scheduler, "long", 60, first=20, max_tokens=2, prompt_logprobs=1)
    for _ in range(12):
        plan, _ = step(scheduler)
        assert all(s.layers is None for s in plan.seqs)

"""Context mirrors: the reference attention over a mirror equals the gathered path, chunk after
chunk, and a mirror is dropped, rebuilt or refused whenever it could disagree with the blocks."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels.metadata import build_attention_metadata, metadata_from_table
from kernels.reference import paged_attention, store_kv
from services.executor.context_mirror import ContextMirrors
from shared.protocol import ScheduledSeq

LAYERS, BLOCKS, BLOCK, KV_HEADS, HEADS, DIM = 2, 64, 4, 2, 4, 8


def pool() -> torch.Tensor:  # [L, 2, blocks, block_size, kv_heads, D], random stale contents
    return torch.randn(
        LAYERS, 2, BLOCKS, BLOCK, KV_HEADS, DIM, generator=torch.Generator().manual_seed(0)
    )


def seq(seq_id: int, start: int, n: int, sample: bool = False, prompt_len=None) -> ScheduledSeq:
    return ScheduledSeq(seq_id, [1] * n, start, [], False, sample=sample, prompt_len=prompt_len)


def table(blocks: list[int]) -> torch.Tensor:  # [1, max_blocks]
    return torch.tensor([blocks], dtype=torch.int64)


def chunk_step(
    kv: torch.Tensor, blocks: list[int], start: int, n: int, mirror, gen: torch.Generator
) -> list[torch.Tensor]:
    """One prompt chunk of n tokens at `start` through every layer; its outputs per layer."""
    meta = metadata_from_table([n], [start], table(blocks), BLOCK, mirrors=[mirror])
    # A mirrored one-token chunk is a span of its own, not a row of the decode batch.
    assert meta.reference.mirrored == (mirror is not None)
    outs = []
    for layer in range(LAYERS):
        q = torch.randn(n, HEADS, DIM, generator=gen)
        k = torch.randn(n, KV_HEADS, DIM, generator=gen)
        v = torch.randn(n, KV_HEADS, DIM, generator=gen)
        store_kv(k, v, kv[layer, 0], kv[layer, 1], meta.slot_mapping)
        extra = {"layer": layer} if mirror is not None else {}
        outs.append(paged_attention(q, kv[layer, 0], kv[layer, 1], meta, 0.3, k, v, **extra))
    return outs


@pytest.mark.parametrize("prompt_len_from", ["first_chunk", "first_deep_chunk"])
def test_attention_over_a_mirror_equals_the_gathered_context_chunk_after_chunk(prompt_len_from):
    blocks = [9, 3, 40, 7, 22, 51, 13, 30, 2, 61]  # 40 positions, scattered
    gathered, mirrored = pool(), pool()
    mirrors = ContextMirrors(mirrored, budget_bytes=1 << 20, max_len=BLOCKS * BLOCK, min_context=8)
    start = 0
    # A prompt of 26 tokens, known to be that long from its first chunk (as the scheduler sends
    # it), is mirrored from that chunk on: no fill from the blocks. Known only from its first
    # chunk at min_context or deeper, the mirror starts there, filled once. One-token chunks
    # deep in a prompt read the mirror too, the prompt's last one (it samples) included.
    steps = [(6, 0), (3, 0), (5, 0), (1, 0), (2, 0), (1, 0), (7, 0), (1, 1)]
    from_start = prompt_len_from == "first_chunk"
    told = False
    for n, sample in steps:
        gen_a, gen_b = torch.Generator().manual_seed(start), torch.Generator().manual_seed(start)
        tell = not told and (from_start or start >= 8)
        told |= tell
        entry = seq(1, start, n, bool(sample), prompt_len=26 if tell else None)
        [mirror] = mirrors.for_step([entry], table(blocks))
        assert (mirror is None) == (not from_start and start < 8)
        expected = chunk_step(gathered, blocks, start, n, None, gen_a)
        got = chunk_step(mirrored, blocks, start, n, mirror, gen_b)
        for e, g in zip(expected, got, strict=True):
            torch.testing.assert_close(g, e)
        start += n
    assert mirrors.made == 1
    # Filled once at the first deep chunk when started there; else only ever appended to.
    assert mirrors.fills == (0 if from_start else 1)
    # The mirror holds exactly what the blocks hold, position by position.
    held = mirrors.mirrors[1][:, :, :, :start]  # [L, 2, kv_heads, start, D]
    from_blocks = mirrored[:, :, blocks].reshape(LAYERS, 2, -1, KV_HEADS, DIM)[:, :, :start]
    torch.testing.assert_close(held, from_blocks.permute(0, 1, 3, 2, 4))
    # The decode after the prompt goes to the decode batch: the mirror is dropped.
    assert mirrors.for_step([seq(1, start, 1, sample=True)], table(blocks)) == [None]
    assert not mirrors.mirrors


def test_a_sequence_that_skips_a_step_or_restarts_is_rebuilt_from_its_blocks():
    mirrors = ContextMirrors(pool(), budget_bytes=1 << 20, max_len=BLOCKS * BLOCK, min_context=8)
    blocks = table(list(range(10)))
    mirrors.for_step([seq(1, 8, 4)], blocks)
    mirrors.for_step([seq(1, 12, 4)], blocks)  # the next chunk: appended, no fill
    assert mirrors.fills == 1 and mirrors.lengths[1] == 16
    mirrors.for_step([seq(2, 8, 4)], blocks)  # 1 is absent this step: dropped
    assert 1 not in mirrors.mirrors and mirrors.fills == 2
    mirrors.for_step([seq(2, 8, 4)], blocks)  # the same start again (a recompute): rebuilt
    assert mirrors.fills == 3 and mirrors.lengths[2] == 12
    mirrors.for_step([seq(2, 12, 1, sample=True)], blocks)  # a decode: dropped, none made
    assert not mirrors.mirrors and mirrors.bytes_held() == 0
    mirrors.for_step([seq(3, 8, 4, prompt_len=13)], blocks)
    speculating = ScheduledSeq(3, [1, 5], 12, [], False, sample=True, num_spec_tokens=1)
    assert mirrors.for_step([speculating], blocks) == [None] and not mirrors.mirrors
    mirrors.for_step([seq(4, 8, 4)], blocks)
    mirrors.forget(4)  # freed: gone at once
    assert not mirrors.mirrors


def test_speculating_rows_and_shallow_chunks_get_no_mirror():
    mirrors = ContextMirrors(pool(), budget_bytes=1 << 20, max_len=BLOCKS * BLOCK, min_context=8)
    spec = ScheduledSeq(1, [1] * 4, 20, [], False, sample=True, num_spec_tokens=3)
    shallow = seq(2, 4, 4)
    assert mirrors.for_step([spec, shallow], table(list(range(10))).repeat(2, 1)) == [None, None]


def test_a_mirror_is_made_whole_within_the_budget_and_growth_keeps_what_was_written():
    per_position = LAYERS * 2 * KV_HEADS * DIM * 4
    mirrors = ContextMirrors(pool(), budget_bytes=100 * per_position, max_len=64, min_context=8)
    blocks = table(list(range(BLOCKS)))
    [first] = mirrors.for_step([seq(1, 8, 8)], blocks)
    assert first.shape[3] == 64  # the longest sequence at once: no growth mid-prompt
    first[:, :, :, 8:16] = 5.0  # what the attention would append
    again, second = mirrors.for_step([seq(1, 16, 8), seq(2, 8, 8)], blocks.repeat(2, 1))
    assert again is first and second.shape[3] == 36  # what the budget has left
    _, refused = mirrors.for_step([seq(1, 24, 8), seq(2, 16, 32)], blocks.repeat(2, 1))
    assert refused is None and 2 not in mirrors.mirrors  # 48 positions do not fit in 36
    mirrors.budget_bytes = 300 * per_position
    [grown] = mirrors.for_step([seq(1, 32, 40)], blocks)
    assert grown.shape[3] == 72 and mirrors.fills == 2  # seq 1 once, seq 2 once
    assert bool((grown[:, :, :, 8:16] == 5.0).all())


def test_a_mirrored_span_without_its_layer_is_refused():
    kv = pool()
    mirrors = ContextMirrors(kv, budget_bytes=1 << 20, max_len=BLOCKS * BLOCK, min_context=8)
    [mirror] = mirrors.for_step([seq(1, 8, 2)], table(list(range(10))))
    meta = build_attention_metadata([2], [8], [list(range(10))], BLOCK)
    meta.reference.prefills[0].mirror = mirror
    meta.reference.mirrored = True
    q, k = torch.randn(2, HEADS, DIM), torch.randn(2, KV_HEADS, DIM)
    with pytest.raises(ValueError, match="layer"):
        paged_attention(q, kv[0, 0], kv[0, 1], meta, 0.3, k, k)


def test_a_later_layer_part_continues_its_mirror_or_refills_it_through_its_chunk():
    # A deep chunk computed in layer parts: the part after the first finds the chunk's
    # positions already in the mirror (its earlier layers wrote them), and a mirror lost in
    # between (the sequence missed a step) comes back filled through the chunk's end.
    kv = pool()
    blocks = list(range(10))  # 40 positions
    mirrors = ContextMirrors(kv, budget_bytes=1 << 20, max_len=BLOCKS * BLOCK, min_context=8)
    first = replace(seq(1, 12, 6), layers=(0, 1))
    later = replace(seq(1, 12, 6), layers=(1, 2))
    [mirror] = mirrors.for_step([first], table(blocks))
    fills = mirrors.fills
    [again] = mirrors.for_step([later], table(blocks))
    assert again is mirror and mirrors.fills == fills  # continued, not rebuilt
    mirrors.for_step([], table(blocks))  # a step without it: the mirror goes
    [refilled] = mirrors.for_step([later], table(blocks))
    assert mirrors.fills == fills + 1
    # [L, 2, positions, kv_heads, D] from the blocks -> the mirror's [L, 2, kv_heads, pos, D]
    expected = kv[:, :, blocks].reshape(LAYERS, 2, -1, KV_HEADS, DIM)[:, :, :18]
    assert torch.equal(refilled[:, :, :, :18], expected.permute(0, 1, 3, 2, 4))

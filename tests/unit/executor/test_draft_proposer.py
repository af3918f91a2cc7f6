"""The draft proposer against transformers' own draft model: its proposals are the draft's greedy
continuation through catch-up, rollback and replaced tables; sampled proposals follow the
distribution it returns, reproducibly per seed."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from scipy.stats import chisquare

from kernels.ops import select_ops
from services.executor.block_tables import DeviceBlockTables
from services.executor.draft_proposer import DraftProposer
from services.executor.kv_cache import KVCache
from services.executor.sampling_state import SamplingStates
from services.executor.weights import load_model
from shared.config import CacheConfig
from shared.protocol import DRAFT_TOKEN, ScheduledSeq
from shared.sampling import SamplingParams
from tests.factories import make_tiny_llama, random_prompts
from tests.support.reference_model import VOCAB, hf_generate

BLOCK = 16
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory):
    return make_tiny_llama(
        tmp_path_factory.mktemp("draft"), seed=1, hidden_size=32, num_layers=1, num_heads=2,
        num_kv_heads=1,
    )  # fmt: skip


def _proposer(draft_dir, num_blocks: int = 64) -> DraftProposer:
    ops = select_ops("torch", CPU)
    model = load_model(draft_dir, torch.float32, 512, ops, CPU)
    cache = KVCache(
        model.kv_layout,
        CacheConfig(block_size=BLOCK, num_device_blocks=num_blocks, swap_space_bytes=0),
        torch.float32,
        CPU,
        ops,
    )
    sampling = SamplingStates(VOCAB, (2,), CPU, seed=0, make_matcher=None)
    tables = DeviceBlockTables(512 // BLOCK, CPU)
    return DraftProposer(model, cache, tables, sampling, 16, reference_views=True)


class _Seq:
    """One sequence fed to the proposer as the executor would: table updates, then fill()."""

    def __init__(self, proposer: DraftProposer, seq_id: int, first_block: int, params) -> None:
        self.proposer, self.seq_id, self.next_block = proposer, seq_id, first_block
        self.blocks: list[int] = []
        self.sent = 0
        proposer.sampling.add(seq_id, params)

    def entry(
        self, token_ids: list[int], start_pos: int, k: int = 0, replace: bool = False
    ) -> ScheduledSeq:
        """The plan entry, its table update applied as the executor applies it."""
        end = start_pos + len(token_ids) + k
        while len(self.blocks) * BLOCK < end:
            self.blocks.append(self.next_block)
            self.next_block += 1
        delta = list(self.blocks) if replace else self.blocks[self.sent :]
        self.sent = len(self.blocks)
        seq = ScheduledSeq(
            self.seq_id, token_ids + [DRAFT_TOKEN] * k, start_pos, delta, replace, True,
            num_spec_tokens=k,
        )  # fmt: skip
        self.proposer.block_tables.update(self.seq_id, delta, replace)
        return seq

    def step(self, token_ids: list[int], start_pos: int, k: int = 0, replace: bool = False):
        seq = self.entry(token_ids, start_pos, k, replace)
        probs = self.proposer.fill([seq])
        return seq.token_ids[len(token_ids) :], probs.get(self.seq_id)


def test_greedy_proposals_are_the_drafts_continuation(draft_dir) -> None:
    proposer = _proposer(draft_dir)
    prompt = random_prompts([37], VOCAB, seed=5)[0]
    seq = _Seq(proposer, 1, 0, SamplingParams(temperature=0.0))
    assert seq.step(prompt, 0) == ([], None)  # a prompt step: learned, nothing proposed
    history = prompt + [7]
    for accept in (3, 0, 1, 5, 2):
        k = 5
        proposals, probs = seq.step([history[-1]], len(history) - 1, k)
        assert probs is None
        assert proposals == hf_generate(draft_dir, tuple(history), k)
        # The target keeps `accept` proposals and a token of its own (none the draft chose).
        kept = proposals[:accept] + [(proposals[accept] + 1) % VOCAB if accept < k else 11]
        proposer.accepted(1, len(history) + len(kept) - 1)
        history += kept
    # A replaced table (swap-in: new blocks) recomputes the draft KV from the token map.
    seq.blocks = []
    seq.next_block = 40
    proposer.apply([], [], [(b, 40 + i) for i, b in enumerate(range(len(history) // BLOCK + 1))])
    proposals, _ = seq.step([history[-1]], len(history) - 1, 3, replace=True)
    assert proposer._seqs[1].blocks[0] == 40
    assert proposals == hf_generate(draft_dir, tuple(history), 3)


def test_batched_sequences_of_different_k(draft_dir) -> None:
    proposer = _proposer(draft_dir)
    prompts = random_prompts([5, 20, 33], VOCAB, seed=6)
    seqs = [_Seq(proposer, i, 10 * i, SamplingParams(temperature=0.0)) for i in range(len(prompts))]
    planned = []
    for seq, prompt, k in zip(seqs, prompts, (1, 4, 2)):
        seq.step(prompt[:-1], 0)
        planned.append(seq.entry([prompt[-1]], len(prompt) - 1, k))
    proposer.fill(planned)
    for prompt, entry in zip(prompts, planned):
        k = entry.num_spec_tokens
        assert entry.token_ids[1:] == hf_generate(draft_dir, tuple(prompt), k)


def test_sampled_proposals_follow_their_distribution_and_repeat_per_seed(draft_dir) -> None:
    prompt = random_prompts([12], VOCAB, seed=7)[0]
    params = SamplingParams(temperature=0.8, top_k=40, seed=0)

    def first_proposal(seed: int):
        proposer = _proposer(draft_dir)
        seq = _Seq(proposer, 1, 0, dataclasses.replace(params, seed=seed))
        seq.step(prompt[:-1], 0)
        proposals, probs = seq.step([prompt[-1]], len(prompt) - 1, 2)
        assert probs.shape == (2, VOCAB)
        assert torch.allclose(probs.sum(dim=-1), torch.ones(2))
        assert int((probs[0] > 0).sum()) == 40  # top-k as the target's sampler applies it
        assert all(float(probs[i, t]) > 0 for i, t in enumerate(proposals))
        return proposals, probs

    first, probs = first_proposal(3)
    assert first_proposal(3)[0] == first  # seeded: the same proposals
    # The first proposal's distribution does not depend on the seed: draws over seeds are
    # samples of it.
    draws = 600
    counts = torch.zeros(VOCAB)
    proposer = _proposer(draft_dir)
    for seed in range(draws):
        seq_id = seed + 1
        seq = _Seq(proposer, seq_id, 0, dataclasses.replace(params, seed=seed))
        seq.step(prompt[:-1], 0)
        proposals, _ = seq.step([prompt[-1]], len(prompt) - 1, 1)
        counts[proposals[0]] += 1
        proposer.forget([seq_id])
    expected = probs[0] * draws
    support = expected > 0
    assert int(counts[~support].sum()) == 0
    # Pool the rare tokens so every cell expects at least 5 draws.
    common = expected >= 5
    rare = support & ~common
    observed = [*counts[common].tolist(), *([counts[rare].sum().item()] if rare.any() else [])]
    wanted = [*expected[common].tolist(), *([expected[rare].sum().item()] if rare.any() else [])]
    scale = sum(observed) / sum(wanted)  # chisquare wants equal totals
    assert chisquare(observed, [w * scale for w in wanted]).pvalue > 1e-3


def test_a_swapped_sequence_recomputes_even_into_the_same_block_ids(draft_dir) -> None:
    proposer = _proposer(draft_dir)
    prompt = random_prompts([40], VOCAB, seed=9)[0]
    seq = _Seq(proposer, 1, 0, SamplingParams(temperature=0.0))
    seq.step(prompt[:-1], 0)
    proposals, _ = seq.step([prompt[-1]], len(prompt) - 1, 3)
    proposer.accepted(1, len(prompt))
    history = prompt + [proposals[0] + 1]
    blocks = list(seq.blocks)
    proposer.apply([(b, i) for i, b in enumerate(blocks)], [], [])
    proposer.cache.device.normal_()  # others' draft KV written into the freed blocks meanwhile
    proposer.apply([], [(i, b) for i, b in enumerate(blocks)], [])  # back into the same ids
    proposals, _ = seq.step([history[-1]], len(history) - 1, 3, replace=True)
    assert proposals == hf_generate(draft_dir, tuple(history), 3)

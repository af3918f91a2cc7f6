"""logit_bias on the device per request: built once, shared by forks, added to its own rows."""

from __future__ import annotations

import torch

from services.executor.counter_rng import row_key
from services.executor.sampler import sample
from services.executor.sampling_state import Draw, SamplingStates
from shared.sampling import SamplingParams
from tests.support.sampling_reference import EOS, VOCAB, random_logits, reference_draw

PROMPT = [4, 7, 7, 11, 12]
# Names a quarter of the 40-token vocabulary or more: a dense row. Smaller biases stay sparse.
MANY = {str(t): (-1.0) ** t * (t % 7) for t in range(20, 30)} | {"7": 6.0, "8": -100}


def test_bias_rows_apply_to_their_own_rows_in_a_mixed_batch_with_forks():
    params = {
        0: SamplingParams(temperature=0.0),
        1: SamplingParams(temperature=1.0, logit_bias=MANY, seed=4),
        2: SamplingParams(
            temperature=0.0, logit_bias={"3": 100, "9": -100}, min_tokens=2, stop_token_ids=(3,)
        ),
        3: SamplingParams(temperature=0.8, logit_bias={"12": 4.0}, seed=9),
    }
    states = SamplingStates(VOCAB, EOS, torch.device("cpu"), seed=0, make_matcher=None)
    for seq_id, p in params.items():
        states.add(seq_id, p)
        states.observe(seq_id, PROMPT, 0, samples=True)
    for child, index in ((4, 1), (5, 2)):  # parallel samples of request 1
        states.fork(1, child, index)
        params[child] = params[1]
    # A fork shares its parent's row: nothing is rebuilt per sample or per step.
    assert states.seqs[4].bias is states.seqs[1].bias is states.seqs[5].bias
    assert states.seqs[0].bias is None
    assert states.seqs[1].bias.row is not None and states.seqs[2].bias.row is None

    # Forks read their parent's logits row; draws interleave rows with and without a bias.
    draws = [Draw(0, 0), Draw(1, 1), Draw(2, 2), Draw(1, 4), Draw(3, 3), Draw(1, 5)]
    for trial in range(8):
        logits = random_logits(4, seed=trial)
        logits[:, [2, 3, 8, 9]] += 4.0  # attractive, so the negative biases and bans matter
        batch = states.build(draws)
        assert batch.bias_rows.tolist() == [1, 3, 5]  # the dense rows: request 1's samples
        # Sparse biases (rows 2 and 4) and the min_tokens bans of row 2 (eos 2 and stop 3).
        assert sorted(batch.edit_rows.tolist()) == [2, 2, 2, 2, 4]
        tokens = states.results(draws, sample(logits.clone(), batch))
        for draw, token in zip(draws, tokens):
            state = states.seqs[draw.seq_id]
            key = row_key(state.seed, state.sample_index, 0)
            expected = reference_draw(logits[draw.logits_row], params[draw.seq_id], key, PROMPT, [])
            assert token.token_id == expected, (trial, draw)


def test_a_bias_row_is_no_per_token_edit_and_logprobs_stay_the_models_own():
    states = SamplingStates(VOCAB, EOS, torch.device("cpu"), seed=0, make_matcher=None)
    states.add(0, SamplingParams(temperature=0.0, logit_bias=MANY | {"5": 100}, logprobs=0))
    states.add(1, SamplingParams(temperature=0.0))
    for seq_id in (0, 1):
        states.observe(seq_id, PROMPT, 0, samples=True)
    logits = random_logits(2)
    batch = states.build([Draw(0, 0), Draw(1, 1)])
    assert batch.edit_rows is None and batch.bias_rows.tolist() == [0]
    out = sample(logits.clone(), batch)
    assert out.token_ids.tolist() == [5, int(logits[1].argmax())]
    assert torch.allclose(out.logprobs[0], torch.log_softmax(logits[0], -1)[5])

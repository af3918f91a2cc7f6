"""Speculative decoding through `pagedserve serve`: a streamed greedy completion equals the
in-process engine's plain decoding, and /metrics counts proposed and accepted tokens."""

from __future__ import annotations

import aiohttp
import openai
import pytest
from transformers import AutoTokenizer

from services.engine.llm_engine import LLMEngine
from shared.sampling import SamplingParams
from tests.factories import engine_config, random_prompts
from tests.service.stack_process import API_KEY, ServeProcess, metric
from tests.support.reference_model import VOCAB

# Prompts that repeat themselves: the lookup proposes, and some proposals are accepted.
PROMPTS = [p * 3 for p in random_prompts([4, 9, 17, 30], VOCAB, seed=1)]
MAX_TOKENS = 60


@pytest.fixture(scope="module")
def spec_stack(tiny_model_dir):
    serve = ServeProcess(
        tiny_model_dir,
        "--num-device-blocks", "128", "--max-num-seqs", "4", "--block-size", "8",
        "--speculative-method", "ngram", "--num-speculative-tokens", "3", "--ngram-min", "1",
        "--speculative-max-batch", "4",
        "--no-speculative-adaptive",
    )  # fmt: skip
    try:
        yield serve
    finally:
        assert serve.stop() == 0


async def test_streamed_greedy_text_is_plain_decodings_and_metrics_count_acceptances(
    spec_stack, tiny_model_dir
):
    engine = LLMEngine(engine_config(tiny_model_dir, block_size=8))
    greedy = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True)
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    client = openai.OpenAI(base_url=f"{spec_stack.url}/v1", api_key=API_KEY, max_retries=0)
    for prompt in PROMPTS:
        plain = engine.generate([prompt], greedy)[0].outputs[0].token_ids
        stream = client.completions.create(
            model=spec_stack.model, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0.0,
            stream=True, extra_body={"ignore_eos": True},
        )  # fmt: skip
        text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
        assert text == tokenizer.decode(plain, skip_special_tokens=True)

    async with aiohttp.ClientSession() as session:
        url = spec_stack.url
        proposed = await metric(session, url, "pagedserve_spec_decode_proposed_tokens_total")
        accepted = await metric(session, url, "pagedserve_spec_decode_accepted_tokens_total")
        rate = await metric(session, url, "pagedserve_spec_decode_acceptance_rate")
    assert proposed > accepted > 0
    assert rate == pytest.approx(accepted / proposed)

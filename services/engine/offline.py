"""`pagedserve generate`: JSONL prompts through the in-process engine into JSONL results."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any, TextIO

from services.engine.llm_engine import LLMEngine, RequestOutput
from shared.chat import chat_prompt_ids
from shared.errors import InvalidRequestError, PagedServeError
from shared.sampling import BY_NAME_FIELDS, SamplingParams
from shared.structured import guided_from_body

# A line's sampling fields: those a request gives by name, as shared/sampling.py declares them.
SAMPLING_FIELDS = BY_NAME_FIELDS


def add_generate_args(parser: argparse.ArgumentParser) -> None:
    io = parser.add_argument_group("input and output")
    io.add_argument(
        "--input", required=True, help="JSONL: prompt | prompt_token_ids | messages per line"
    )
    io.add_argument("--output", required=True, help="JSONL file for the results; - for stdout")
    io.add_argument(
        "--chat",
        action="store_true",
        help="wrap text prompts in the model's chat template as one user message",
    )
    sampling = parser.add_argument_group("default sampling (each input line may override)")
    sampling.add_argument("--n", type=int, default=1)
    sampling.add_argument("--max-tokens", type=int, default=128)
    sampling.add_argument("--temperature", type=float, default=0.0)
    sampling.add_argument("--top-p", type=float, default=1.0)
    sampling.add_argument("--top-k", type=int, default=0)
    sampling.add_argument("--seed", type=int, default=None)
    sampling.add_argument("--stop-token-ids", type=int, nargs="*", default=[])
    sampling.add_argument("--ignore-eos", action="store_true")
    sampling.add_argument("--logprobs", type=int, default=None, help="top logprobs per token")
    sampling.add_argument(
        "--beam-width",
        type=int,
        default=None,
        metavar="W",
        help="beam search with W beams (W best hypotheses returned) for lines without their "
        "own use_beam_search",
    )
    sampling.add_argument("--length-penalty", type=float, default=1.0, help="beam search only")


def default_sampling(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(
        n=args.n if args.beam_width is None else args.beam_width,
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop_token_ids=tuple(args.stop_token_ids),
        ignore_eos=args.ignore_eos,
        logprobs=args.logprobs,
        use_beam_search=args.beam_width is not None,
        length_penalty=args.length_penalty,
    )


def prompt_ids(engine: LLMEngine, line: dict[str, Any], chat: bool) -> list[int]:
    """Token ids of one input line's prompt, from whichever form it gives."""
    forms = [k for k in ("prompt", "prompt_token_ids", "messages") if k in line]
    if len(forms) != 1:
        raise InvalidRequestError(
            "each line needs exactly one of prompt, prompt_token_ids, messages"
        )
    if "prompt_token_ids" in line:
        ids = line["prompt_token_ids"]
        if not isinstance(ids, list) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids
        ):
            raise InvalidRequestError(
                "prompt_token_ids must be a list of integers", param="prompt_token_ids"
            )
        return ids
    if "messages" in line:
        return chat_prompt_ids(engine.tokenizer, line["messages"])
    if not isinstance(line["prompt"], str):
        raise InvalidRequestError("prompt must be a string", param="prompt")
    if chat:
        return chat_prompt_ids(engine.tokenizer, [{"role": "user", "content": line["prompt"]}])
    return engine.tokenizer.encode(line["prompt"], add_special_tokens=False)


def run_generate(args: argparse.Namespace, engine: LLMEngine) -> int:
    defaults = default_sampling(args)
    with open(args.input, encoding="utf-8") as f:
        lines = [raw for raw in f if raw.strip()]
    rows: list[dict[str, Any] | None] = [None] * len(lines)
    request_of: dict[str, int] = {}
    for index, raw in enumerate(lines):
        try:
            line = json.loads(raw)
            if not isinstance(line, dict):
                raise InvalidRequestError("each line must be a JSON object")
            overrides = {k: line[k] for k in SAMPLING_FIELDS if k in line}
            if line.get("use_beam_search") is False and "n" not in line:
                overrides["n"] = args.n  # --beam-width's n is for beam-search lines only
            # response_format or guided_json/regex/choice/grammar
            guided = guided_from_body(line, engine.config.grammar.limits)
            if guided is not None:
                overrides["guided"] = guided
            sampling = SamplingParams.from_dict(overrides, base=defaults)
            request_of[engine.add_request(prompt_ids(engine, line, args.chat), sampling)] = index
        except json.JSONDecodeError as exc:
            rows[index] = {
                "index": index,
                "error": InvalidRequestError(f"invalid JSON: {exc}").to_dict()["error"],
            }
        except PagedServeError as exc:
            rows[index] = {"index": index, "error": exc.to_dict()["error"]}
    from tqdm import tqdm

    with tqdm(total=len(request_of), desc="generate", unit="req", file=sys.stderr) as bar:
        while engine.has_unfinished():
            for update in engine.step():
                if update.finished:
                    out = RequestOutput.from_group(update.group)
                    rows[request_of[out.request_id]] = _result_row(
                        engine, request_of[out.request_id], out
                    )
                    bar.update(1)
    out_file: TextIO = (
        sys.stdout if args.output == "-" else open(args.output, "w", encoding="utf-8")
    )
    try:
        for row in rows:
            out_file.write(json.dumps(row, ensure_ascii=False) + "\n")
    finally:
        if out_file is not sys.stdout:
            out_file.close()
    failed = sum(1 for r in rows if r and "error" in r)
    if failed:
        print(
            f"{failed} of {len(rows)} lines were rejected (see their error fields)", file=sys.stderr
        )
    return 0


def _result_row(engine: LLMEngine, index: int, out: RequestOutput) -> dict[str, Any]:
    completions = []
    for completion in out.outputs:
        entry: dict[str, Any] = {
            "text": engine.tokenizer.decode(completion.token_ids, skip_special_tokens=True),
            "token_ids": completion.token_ids,
            "finish_reason": completion.finish_reason,
        }
        if completion.cumulative_logprob is not None:
            entry["cumulative_logprob"] = completion.cumulative_logprob
        if completion.logprobs is not None:
            entry["logprobs"] = [
                {"token_id": t.token_id, "logprob": t.logprob, "top_logprobs": t.top_logprobs}
                for t in completion.logprobs
            ]
        completions.append(entry)
    row: dict[str, Any] = {"index": index, "prompt_tokens": len(out.prompt_token_ids)}
    if out.prompt_logprobs is not None:  # position 0 has none
        scored = out.prompt_logprobs
        row["prompt_logprobs"] = [None] + [
            {"token_id": t.token_id, "logprob": t.logprob, "rank": rank}
            | {"top_logprobs": t.top_logprobs}
            for t, rank in zip(scored.tokens, scored.ranks)
        ]
    if len(completions) == 1:
        row.update(completions[0])
    else:
        row["outputs"] = completions
    return row

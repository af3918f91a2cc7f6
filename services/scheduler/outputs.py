"""What a request has produced, as its client sees it: the wire's RequestDelta for the served
stack and RequestOutput for the in-process engine, both read through reported_samples()."""

from __future__ import annotations

from dataclasses import dataclass

from services.scheduler.scheduler import GroupUpdate
from services.scheduler.sequence import SeqStatus, SequenceGroup
from shared.protocol import NextTokens, PromptLogprobs, RequestDelta, SampledToken, SeqDelta


def reported_samples(group: SequenceGroup) -> list[SeqDelta]:
    """The samples a response shows, whole and in index order; logprobs only when asked, the
    cumulative logprob wherever the tokens' logprobs were drawn."""
    sampling = group.sampling
    want_logprobs = sampling.logprobs is not None
    return [
        SeqDelta(
            index,
            seq.output_token_ids,
            list(seq.logprobs) if want_logprobs else [],
            seq.finish_reason,
            seq.cumulative_logprob if sampling.wants_logprob else None,
        )
        for index, seq in sorted(group.reported_seqs(), key=lambda pair: pair[0])
    ]


def group_delta(update: GroupUpdate) -> RequestDelta:
    """The request's new tokens per sample, with each ended sample's finish reason."""
    group = update.group
    if group.sampling.reports_at_end:
        # best_of, beam search: the chosen sequences are known only at the end; they go out
        # whole then.
        seqs = reported_samples(group)
        if group.beam is None:
            for sample in seqs:  # the API shows a cumulative logprob beside beams only
                sample.cumulative_logprob = None
    else:
        want_logprobs = group.sampling.logprobs is not None
        by_index: dict[int, SeqDelta] = {}
        for seq, token in update.new_tokens:
            delta = by_index.setdefault(seq.index, SeqDelta(seq.index, []))
            delta.token_ids.append(token.token_id)
            if want_logprobs:
                delta.logprobs.append(token)
        for seq in group.seqs:
            if seq.is_finished:
                by_index.setdefault(
                    seq.index, SeqDelta(seq.index, [])
                ).finish_reason = seq.finish_reason
        seqs = [by_index[i] for i in sorted(by_index)]
    return RequestDelta(
        group.request_id,
        seqs,
        update.finished,
        update.error,
        num_prompt_tokens=group.seqs[0].prompt_len,
        prompt_logprobs=_unsent_prompt_logprobs(group),
    )


def step_deltas(updates: list[GroupUpdate]) -> tuple[list[RequestDelta], NextTokens]:
    """A step's updates as the gateway gets them: the plain one-token deltas of most requests
    as NextTokens columns (NextTokens.delta(i) is what group_delta would have made), the rest
    as RequestDelta records."""
    deltas: list[RequestDelta] = []
    plain = NextTokens()
    for update in updates:
        group = update.group
        sampling = group.sampling
        if (
            len(update.new_tokens) == 1
            and len(group.seqs) == 1
            and not update.finished
            and update.error is None
            and sampling.logprobs is None
            and sampling.prompt_logprobs is None
            and not sampling.reports_at_end
        ):
            seq, token = update.new_tokens[0]
            if seq.status is not SeqStatus.FINISHED and seq.index == 0:
                plain.add(group.request_id, token.token_id, seq.prompt_len)
                continue
        deltas.append(group_delta(update))
    return deltas, plain


def _unsent_prompt_logprobs(group: SequenceGroup) -> PromptLogprobs | None:
    """The asked-for prompt logprobs, once all have arrived, in the first delta after that."""
    if group.sampling.prompt_logprobs is None or group.prompt_logprobs_sent:
        return None
    if not group.prompt_logprobs_done:
        return None
    group.prompt_logprobs_sent = True
    return group.prompt_logprobs or PromptLogprobs(group.seqs[0].seq_id, 1, [], [])


@dataclass
class CompletionOutput:
    index: int  # which of the request's n samples
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[SampledToken] | None = None
    cumulative_logprob: float | None = None  # set when the tokens' logprobs were drawn


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    # Asked-for prompt logprobs: positions 1 .. of the prompt (position 0 has none); None
    # until all have arrived.
    prompt_logprobs: PromptLogprobs | None = None

    @classmethod
    def from_group(cls, group: SequenceGroup) -> RequestOutput:
        want_logprobs = group.sampling.logprobs is not None
        outputs = [
            CompletionOutput(
                s.index,
                s.token_ids,
                s.finish_reason,
                s.logprobs if want_logprobs else None,
                s.cumulative_logprob,
            )
            for s in reported_samples(group)
        ]
        prompt = None
        if group.sampling.prompt_logprobs is not None and group.prompt_logprobs_done:
            prompt = group.prompt_logprobs or PromptLogprobs(group.seqs[0].seq_id, 1, [], [])
        return cls(group.request_id, group.prompt_token_ids, outputs, group.is_finished, prompt)

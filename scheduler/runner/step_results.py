"""The step's results as the scheduler takes them: the logits rows that sample, and each
request's sampled token and logprobs, or its prompt's logprobs, as plain Python values
copied off the device once per step."""

from __future__ import annotations

import torch

from model.sampler import SamplerOutput, token_logprobs
from scheduler.request import TokenLogprob
from scheduler.spec.speculation import accepted
from scheduler.step_data import ModelRunnerOutput, SampledToken, ScheduledRequest


def prompt_logprobs(req: ScheduledRequest, logits: torch.Tensor) -> list[TokenLogprob]:
    """logits: one row per token of this chunk; the row at position p scores prompt token
    p + 1. Positions scored before (ahead of a preemption) are skipped."""
    start = req.num_computed_tokens
    first = req.prompt_logprobs_from or 0  # next position to score
    end = min(start + logits.shape[0], len(req.prompt_ids) - 1)
    if end <= first:
        return []
    targets = torch.tensor(req.prompt_ids[first + 1 : end + 1], device=logits.device)
    num_top = req.params.prompt_logprobs or 0
    chosen, top_ids, top_lps = token_logprobs(logits[first - start : end - start], targets, num_top)
    chosen_l = chosen.tolist()
    ids_l = top_ids.tolist() if top_ids is not None else [[] for _ in chosen_l]
    lps_l = top_lps.tolist() if top_lps is not None else [[] for _ in chosen_l]
    return [
        TokenLogprob(token, lp, list(zip(ids, lps, strict=True)))
        for token, lp, ids, lps in zip(targets.tolist(), chosen_l, ids_l, lps_l, strict=True)
    ]


def sampled_rows(logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """The logits rows that sample, as a view where they are consecutive (every step of
    decodes only, and most others): indexing by a list copies them all, 0.8 ms for 32
    rows of a 49k vocabulary on 2 cores, in every step. The sampler never writes to its
    input (model/sampler.py)."""
    first = rows[0]
    if rows == list(range(first, first + len(rows))):
        return logits[first : first + len(rows)]
    return logits[rows]


def sampled_tokens(reqs: list[ScheduledRequest], out: SamplerOutput) -> list[SampledToken]:
    """One per row sampled; `reqs[i]` is the request row i belongs to (a speculating one
    owns several rows)."""
    token_ids, chosen, top_ids, top_lps = _to_host(
        out.token_ids, out.logprobs, out.top_ids, out.top_logprobs
    )
    sampled = []
    for i, req in enumerate(reqs):
        logprob = None
        num_top = req.params.logprobs
        if chosen is not None and num_top is not None:
            top = (
                list(zip(top_ids[i][:num_top], top_lps[i][:num_top], strict=False))
                if top_ids and num_top
                else []
            )
            logprob = TokenLogprob(token_ids[i], chosen[i], top)
        sampled.append(SampledToken(token_ids[i], logprob))
    return sampled


def verified(
    reqs: list[ScheduledRequest], rows: list[SampledToken], result: ModelRunnerOutput
) -> None:
    """Per request, its rows' tokens into `result`: the first as `sampled`; for one that
    speculated, the target's tokens at its accepted guesses and the one after them as
    `sampled_after`."""
    position = 0
    for req in reqs:
        mine = rows[position : position + 1 + len(req.draft_token_ids)]
        position += len(mine)
        result.sampled[req.request_id] = mine[0]
        if req.draft_token_ids:
            count = accepted(req.draft_token_ids, [t.token_id for t in mine])
            result.sampled_after[req.request_id] = mine[1 : count + 1]


def _to_host(*tensors: torch.Tensor | None) -> list[list | None]:
    """As lists, with one wait per step: on a GPU the copies are queued together into
    pinned memory and waited for once (one device-to-host copy when only token ids are
    asked for), where a `tolist` each would wait on the device every time."""
    present = [t for t in tensors if t is not None]
    if present and present[0].device.type == "cuda":
        host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in present]
        for target, source in zip(host, present, strict=True):
            target.copy_(source, non_blocking=True)
        torch.cuda.current_stream(present[0].device).synchronize()
        present = host
    lists = iter([t.tolist() for t in present])
    return [next(lists) if t is not None else None for t in tensors]


def fail_sequences(result: ModelRunnerOutput, reqs: list[ScheduledRequest], message: str) -> None:
    """Takes back whatever the step had given `reqs`: they get `message` instead."""
    for req in reqs:
        result.errors[req.request_id] = message
        result.sampled.pop(req.request_id, None)
        result.sampled_after.pop(req.request_id, None)
        result.prompt_logprobs.pop(req.request_id, None)

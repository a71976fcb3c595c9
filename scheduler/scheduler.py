"""Continuous batching: every step decides which requests run and how many tokens each
feeds, under a token budget and a sequence cap.

Running requests go first (decodes and the next chunk of a partly computed prompt),
then waiting ones are admitted, their prompts split into chunks when the budget is
short. When the cache cannot grow a running request, the most recently admitted one is
preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (its cached prefix blocks usually survive). Nothing is dropped.

The scheduler owns request lifecycles and asks `KVCacheManager` for blocks; it never
runs the model, samples or detokenizes.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field

from scheduler.kv_cache import KVCacheManager
from scheduler.request import InvalidParams, Request, RequestStatus

logger = logging.getLogger(__name__)


class QueueFull(RuntimeError):
    """The waiting queue is at its bound: the server answers 503 rather than queue forever."""


@dataclass
class SchedulerConfig:
    max_model_len: int
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_waiting: int = 1024


@dataclass
class SchedulerOutput:
    """The plan of one step: requests in batch order with how many new tokens each feeds."""

    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(n for _, n in self.scheduled)


class Scheduler:
    def __init__(self, config: SchedulerConfig, kv: KVCacheManager) -> None:
        self.config = config
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        # n > 1: siblings wait until the first sequence has computed the prompt, then
        # share its full blocks by reference instead of computing them again.
        self.forks_pending: dict[str, list[Request]] = {}
        self.num_preemptions = 0

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self.forks_pending.values())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def check_prompt(self, num_prompt_tokens: int, max_tokens: int) -> None:
        limit = self.config.max_model_len
        if num_prompt_tokens < 1:
            raise InvalidParams("prompt", "the prompt is empty")
        if num_prompt_tokens + max_tokens > limit:
            raise InvalidParams(
                "max_tokens",
                f"this model's maximum context length is {limit} tokens, but the request has "
                f"{num_prompt_tokens} prompt tokens and max_tokens={max_tokens} "
                f"({num_prompt_tokens + max_tokens} in all)",
            )

    def add(self, first: Request, siblings: list[Request] | None = None) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests)")
        self.check_prompt(len(first.prompt_ids), first.params.max_tokens)
        self.waiting.append(first)
        if siblings:
            self.forks_pending[first.request_id] = siblings

    def abort(self, request_id: str) -> Request | None:
        """Removes a request wherever it is and frees its blocks."""
        for req in self.running:
            if req.request_id == request_id:
                self.running.remove(req)
                return self._finish(req, "abort")
        for req in self.waiting:
            if req.request_id == request_id:
                self.waiting.remove(req)
                return self._finish(req, "abort")
        for parent, siblings in self.forks_pending.items():
            for req in siblings:
                if req.request_id == request_id:
                    siblings.remove(req)
                    if not siblings:
                        del self.forks_pending[parent]
                    return self._finish(req, "abort")
        return None

    def finish(self, req: Request, reason: str) -> None:
        if req in self.running:
            self.running.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> Request:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req.request_id)
        # Siblings still waiting for this one's prompt are released to compute it alone.
        for sibling in reversed(self.forks_pending.pop(req.request_id, [])):
            self.waiting.appendleft(sibling)
        return req

    def prompt_computed(self, req: Request) -> None:
        """Called once a request's prompt is fully in the cache: forks its siblings."""
        siblings = self.forks_pending.pop(req.request_id, [])
        for sibling in reversed(siblings):
            sibling.num_computed_tokens = self.kv.fork(
                req.request_id, sibling.request_id, len(sibling.prompt_ids)
            )
            sibling.num_cached_tokens = sibling.num_computed_tokens
            sibling.prompt_logprobs = list(req.prompt_logprobs)  # same prompt, same logprobs
            self.waiting.appendleft(sibling)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()

        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            while not self.kv.allocate_slots(
                req.request_id, req.all_token_ids, req.num_computed_tokens, num_new
            ):
                victim = self.running[-1]
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.scheduled.append((req, num_new))
                budget -= num_new

        # Admitting while preempting would take back the blocks just freed.
        while (
            not out.preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
        ):
            req = self.waiting[0]
            holds_blocks = bool(self.kv.block_table(req.request_id))
            if not holds_blocks:
                # Prompt logprobs need the logits of every prompt position: no cached prefix.
                wants_prompt_logits = (
                    req.params.prompt_logprobs is not None
                    and len(req.prompt_logprobs) < len(req.prompt_ids) - 1
                )
                req.num_computed_tokens = (
                    0
                    if wants_prompt_logits
                    else self.kv.get_computed_blocks(req.request_id, req.all_token_ids)
                )
                if req.first_scheduled_time is None:
                    req.num_cached_tokens = req.num_computed_tokens
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(
                req.request_id, req.all_token_ids, req.num_computed_tokens, num_new
            ):
                if not holds_blocks:
                    self.kv.free(req.request_id)
                    req.num_computed_tokens = 0
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
            self.running.append(req)
            out.scheduled.append((req, num_new))
            budget -= num_new
        return out

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.info(
            "request %s preempted after %d tokens (cache full)", req.request_id, req.num_tokens
        )

"""Continuous batching: every step decides which requests run and how many tokens each
feeds, under a token budget and a sequence cap.

Running requests go first (decodes and the next chunk of a partly computed prompt),
then waiting ones are admitted, their prompts split into chunks when the budget is
short. When the cache cannot grow a running request, the most recently admitted one is
preempted: its blocks are freed and it goes back to the front of the queue, to be
recomputed later (its cached prefix blocks usually survive). Nothing is dropped. A
decoding sequence may feed guessed tokens too (scheduler/spec/speculation.py).

One step is three calls, as in vLLM's v1 core: `schedule()` says what runs, the model
runner computes, `update_from_output()` advances computed tokens, appends sampled tokens,
forks n > 1 siblings, finishes and frees. The scheduler is the only writer of a request's
lifecycle state and the only client of `KVCacheManager`; it never runs the model, samples,
detokenizes or imports torch.
"""

from __future__ import annotations

import logging
import time
from collections import deque

from scheduler.config import QueueFull, SchedulerConfig
from scheduler.kv_cache import KVCacheManager
from scheduler.lora_request import admits_adapter
from scheduler.request import Request, RequestStatus
from scheduler.sampling_params import resolve_max_tokens
from scheduler.spec.speculation import Speculator
from scheduler.step_data import (
    DRAFT_SLOT,
    ModelRunnerOutput,
    SampledToken,
    SchedulerOutput,
    SequenceUpdate,
    scheduled_request,
)
from scheduler.structured.manager import StructuredOutputManager

logger = logging.getLogger(__name__)


GRAMMAR_BROKEN = "internal error: a sampled token broke the request's grammar"


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
        self._in_flight: dict[str, Request] = {}  # scheduled this step, by id
        self.structured = StructuredOutputManager()
        self.speculator = (
            Speculator(config.speculative, config.max_model_len) if config.speculative else None
        )

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + sum(len(v) for v in self.forks_pending.values())

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def add(self, first: Request, siblings: list[Request] | None = None) -> None:
        """Queues a request (its n - 1 siblings wait for its prompt); raises QueueFull or
        InvalidParams having queued nothing."""
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests)")
        limit = resolve_max_tokens(
            first.params.max_tokens, len(first.prompt_ids), self.config.max_model_len
        )
        for req in [first, *(siblings or [])]:
            req.max_tokens = limit
        self.waiting.append(first)
        if siblings:
            self.forks_pending[first.request_id] = siblings
        grammar = first.params.grammar
        if grammar is not None:
            for req in [first, *(siblings or [])]:
                self.structured.add(req.request_id, grammar)

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

    def finish(self, req: Request, reason: str, num_output_tokens: int | None = None) -> None:
        """Ends a running request the engine stopped (a stop string in its text, found at
        output length `num_output_tokens`: later tokens of the same step are dropped)."""
        if req.finished:
            return
        if num_output_tokens is not None:
            req.truncate_output(num_output_tokens)
        if req in self.running:
            self.running.remove(req)
        self._finish(req, reason)

    def _finish(self, req: Request, reason: str) -> Request:
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        self.kv.free(req.request_id)
        self.structured.remove(req.request_id)
        # Siblings still waiting for this one's prompt are released to compute it alone.
        for sibling in reversed(self.forks_pending.pop(req.request_id, [])):
            self.waiting.appendleft(sibling)
        return req

    def _fork_siblings(self, req: Request) -> None:
        """Once a request's prompt is fully in the cache, its siblings share those blocks."""
        siblings = self.forks_pending.pop(req.request_id, [])
        for sibling in reversed(siblings):
            sibling.num_computed_tokens = self.kv.fork(
                req.request_id, sibling.request_id, len(sibling.prompt_ids)
            )
            sibling.num_cached_tokens = sibling.num_computed_tokens
            sibling.prompt_logprobs = list(req.prompt_logprobs)  # same prompt, same logprobs
            self.waiting.appendleft(sibling)

    def schedule(self) -> SchedulerOutput:
        """Decides this step's work and reserves its KV blocks; changes no token counts."""
        plan: list[tuple[Request, int, list[int]]] = []  # (request, tokens, guesses)
        preempted: list[Request] = []
        budget = self.config.max_num_batched_tokens
        now = time.monotonic()
        spec = self.speculator
        speculating = spec is not None and spec.active(len(self.running))
        for req in list(self.running):
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if budget == 0:
                break
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            # Guesses only while every running sequence could still grow by a block.
            roomy = speculating and self.kv.num_free_blocks > len(self.running)
            drafts = spec.drafts(req, budget - 1) if roomy and num_new == 1 else []
            if drafts and drafts[0] != DRAFT_SLOT and req.request_id in self.structured:
                drafts = self.structured.allowed_guesses(req.request_id, drafts)
            # A running request's blocks already chain from its adapter's salt.
            while not self.kv.allocate_slots(
                req.request_id, req.all_token_ids, req.num_computed_tokens, num_new + len(drafts)
            ):
                if drafts:  # guesses are the first thing given up
                    drafts = []
                    continue
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            else:
                plan.append((req, num_new, drafts))
                budget -= num_new + len(drafts)

        # Admitting while preempting would take back the blocks just freed.
        while (
            not preempted
            and self.waiting
            and budget > 0
            and len(self.running) < self.config.max_num_seqs
            and admits_adapter(self.waiting[0].lora, self.running, self.config.max_loras)
        ):
            req = self.waiting[0]
            holds_blocks = bool(self.kv.block_table(req.request_id))
            if not holds_blocks:
                self._attach_cached_prefix(req)
            num_new = min(req.num_tokens - req.num_computed_tokens, budget)
            if not self.kv.allocate_slots(
                req.request_id, req.all_token_ids, req.num_computed_tokens, num_new, req.cache_salt
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
            plan.append((req, num_new, []))
            budget -= num_new

        self._in_flight = {req.request_id: req for req, _, _ in plan}
        scheduled = [
            scheduled_request(req, num_new, drafts, self.kv.block_table(req.request_id))
            for req, num_new, drafts in plan
        ]
        self.structured.fill_rows(scheduled)
        return SchedulerOutput(
            scheduled=scheduled,
            preempted_ids=[req.request_id for req in preempted],
            running_lora_ids=frozenset(r.lora.lora_id for r in self.running if r.lora),
        )

    def _attach_cached_prefix(self, req: Request) -> None:
        # Prompt logprobs need the logits of every prompt position: no cached prefix.
        req.num_computed_tokens = (
            0
            if req.owes_prompt_logprobs
            else self.kv.get_computed_blocks(req.request_id, req.all_token_ids, req.cache_salt)
        )
        if req.first_scheduled_time is None:
            req.num_cached_tokens = req.num_computed_tokens

    def update_from_output(
        self, out: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[SequenceUpdate]:
        """The only place a step's results move requests forward: computed tokens, prompt
        logprobs, sampled tokens, forks of n > 1 siblings, stop tokens and lengths; what
        finished is freed here. Returns one update per token sampled (a speculating
        sequence may take several, scheduler/spec/speculation.py) and per sequence failed."""
        updates: list[SequenceUpdate] = []
        for scheduled in out.scheduled:
            req = self._in_flight[scheduled.request_id]
            if req.finished:
                continue
            error = result.errors.get(req.request_id)
            if error is not None:
                self.finish(req, "error")
                updates.append(SequenceUpdate(req, finish_reason="error", error=error))
                continue
            drafts = scheduled.draft_token_ids
            req.num_computed_tokens += len(scheduled.new_token_ids) - len(drafts)
            req.prompt_logprobs += result.prompt_logprobs.get(req.request_id, [])
            if not scheduled.sample:
                continue
            if not req.output_ids:
                self._fork_siblings(req)
            emitted = [result.sampled[req.request_id]]
            if drafts:
                emitted += result.sampled_after.get(req.request_id, [])
                guessed = result.guessed(scheduled)
                if guessed:  # a draft may have doubted every guess
                    self.speculator.record(req, guessed, len(emitted) - 1)
            for position, sampled in enumerate(emitted):
                if position:  # the guess before it was right: its K/V is in the cache
                    req.num_computed_tokens += 1
                update = self._take_token(req, sampled)
                updates.append(update)
                if update.finish_reason is not None:
                    break
            if drafts and not req.finished:
                self.kv.trim(req.request_id, req.num_tokens)
        self._in_flight = {}
        return updates

    def _take_token(self, req: Request, sampled: SampledToken) -> SequenceUpdate:
        req.append_output(sampled.token_id)
        reason = None
        if req.request_id in self.structured:
            # The matcher moves with the output and only here; a grammar that has
            # ended (or a refused token) ends the sequence whatever its stop tokens.
            reason = self.structured.accept(req.request_id, sampled.token_id)
        reason = reason or self._stop_reason(req, sampled.token_id)
        if reason is not None:
            self.finish(req, reason)
        if reason == "error":
            return SequenceUpdate(req, finish_reason=reason, error=GRAMMAR_BROKEN)
        return SequenceUpdate(
            req, sampled.token_id, sampled.logprob, reason, num_output_tokens=len(req.output_ids)
        )

    def _stop_reason(self, req: Request, token_id: int) -> str | None:
        if req.may_stop and token_id in req.stop_token_ids:
            return "stop"
        if len(req.output_ids) >= req.max_tokens:
            return "length"
        if req.num_tokens >= self.config.max_model_len:
            return "length"
        return None

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req.request_id)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        self.num_preemptions += 1
        self.waiting.appendleft(req)
        logger.info(
            "request %s preempted after %d tokens (cache full)", req.request_id, req.num_tokens
        )

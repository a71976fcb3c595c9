"""`Engine.step()`: schedule -> build the flat `Batch` -> forward -> sample -> append
tokens, detokenize, check stops -> free what finished. Single-threaded and synchronous;
`AsyncEngine` (async_engine.py) runs it on a background thread for the server.

An error while post-processing one request finishes that request with an error and
leaves the others running; a failed forward fails only the requests of that step.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from model.batch import Batch
from model.llama import Llama
from model.logprobs import token_logprobs
from model.paged_cache import PagedKVCache
from model.sampler import Sampler, SamplerOutput, SamplingMetadata
from model.text.tokenizer import Tokenizer
from scheduler.config import EngineConfig, plan_kv_capacity
from scheduler.kv_cache import KVCacheManager
from scheduler.output_text import OutputText
from scheduler.request import Request, RequestOutput, SamplingParams, TokenLogprob
from scheduler.scheduler import Scheduler, SchedulerConfig
from scheduler.stats import FinishedStats, StepStats

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    """Engine-side state of one sequence: its text and the client-facing identity."""

    request: Request
    group_id: str
    index: int
    text: OutputText
    stop_ids: frozenset[int]
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)


class Engine:
    def __init__(
        self,
        model: Llama,
        tokenizer: Tokenizer,
        kv_cache: PagedKVCache,
        kv_manager: KVCacheManager,
        config: SchedulerConfig,
    ) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.kv_cache = kv_cache
        self.kv = kv_manager
        self.scheduler = Scheduler(config, kv_manager)
        self.sampler = Sampler()
        self.device = model.embed_tokens.weight.device
        self._tracked: dict[str, _Tracked] = {}
        self._groups: dict[str, list[str]] = {}
        # Aborts happen between steps; their stats ride on the next report.
        self._aborted: list[FinishedStats] = []

    # ---- admission -------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_ids: list[int], params: SamplingParams) -> None:
        """Queues a request; n > 1 becomes n sequences reported under the same id with
        indices 0..n-1. Raises InvalidParams or QueueFull, having queued nothing."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        seqs = [self._new_sequence(request_id, i, prompt_ids, params) for i in range(params.n)]
        self.scheduler.add(seqs[0].request, [s.request for s in seqs[1:]])
        self._groups[request_id] = [s.request.request_id for s in seqs]
        for s in seqs:
            self._tracked[s.request.request_id] = s

    def _new_sequence(
        self, group_id: str, index: int, prompt_ids: list[int], params: SamplingParams
    ) -> _Tracked:
        seq_id = group_id if params.n == 1 else f"{group_id}#{index}"
        generator = None
        if params.seed is not None and not params.greedy:
            generator = torch.Generator(device=self.device)
            # Seeds are 64-bit: the n-th sibling's seed wraps around, as torch itself wraps
            # negative seeds, instead of overflowing past 2**64 - 1.
            generator.manual_seed((params.seed + index) % 2**64)
        request = Request(seq_id, list(prompt_ids), params, generator=generator)
        stop_ids = frozenset(params.stop_token_ids) | (
            frozenset() if params.ignore_eos else frozenset(self.tokenizer.stop_ids)
        )
        text = OutputText(
            self.tokenizer, request.prompt_ids, params.stop, params.skip_special_tokens
        )
        return _Tracked(request, group_id, index, text, stop_ids)

    def abort(self, request_id: str) -> None:
        """Drops a request (all n sequences) and frees every block it holds."""
        for seq_id in self._groups.pop(request_id, []):
            req = self.scheduler.abort(seq_id)
            self._tracked.pop(seq_id, None)
            if req is not None:
                self._aborted.append(self._finished_stats(req))

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def idle_stats(self) -> StepStats:
        """A report without a step: the gauges as they are now, and the aborts since the
        last report. Without it, gauges would keep the last step's values after an abort
        or the last finish left the engine idle."""
        stats = StepStats(finished=self._aborted)
        self._aborted = []
        return self._fill_gauges(stats)

    # ---- one step --------------------------------------------------------------------

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        started = time.monotonic()
        plan = self.scheduler.schedule()
        stats = StepStats(num_preemptions=len(plan.preempted), finished=self._aborted)
        self._aborted = []
        if not plan.scheduled:
            return [], self._fill_gauges(stats)
        requests = [r for r, _ in plan.scheduled]
        every_row = [_needs_prompt_logits(r) for r in requests]
        batch = Batch.build(
            [
                r.all_token_ids[r.num_computed_tokens : r.num_computed_tokens + n]
                for r, n in plan.scheduled
            ],
            [r.num_computed_tokens for r in requests],
            [self.kv.block_table(r.request_id) for r in requests],
            self.kv.block_size,
            self.device,
            all_logits=every_row if any(every_row) else False,
        )
        forward_started = time.monotonic()
        try:
            logits = self.model(batch, self.kv_cache)
            stats.forward_s = time.monotonic() - forward_started
        except Exception:
            logger.exception("forward failed; failing the %d requests of this step", len(requests))
            failed = [self._fail(r, "internal error in the model forward") for r in requests]
            return failed, self._fill_gauges(stats)

        rows: list[int] = []  # logits row of each sequence's last new token
        first_row = 0
        for (req, n), every in zip(plan.scheduled, every_row, strict=True):
            if every:
                self._collect_prompt_logprobs(req, logits[first_row : first_row + n])
            first_row += n if every else 1
            req.num_computed_tokens += n
            stats.num_tokens += n
            if req.num_computed_tokens == req.num_tokens:
                rows.append(first_row - 1)
                if not req.output_ids:
                    self.scheduler.prompt_computed(req)
        outputs: list[RequestOutput] = []
        if rows:
            sampled = [r for r in requests if r.num_computed_tokens == r.num_tokens]
            try:
                result = self.sampler(logits[rows], self._sampling_metadata(sampled))
            except Exception:
                # Only the rows that sampled are lost; an exception escaping step() would
                # stop the engine thread and with it every request on the server.
                logger.exception("sampling failed; failing the %d requests it held", len(sampled))
                failed = [self._fail(r, "internal error in the sampler") for r in sampled]
                return failed, self._fill_gauges(stats)
            outputs = self._append_tokens(sampled, result, stats)
        stats.step_time_s = time.monotonic() - started
        return outputs, self._fill_gauges(stats)

    def _collect_prompt_logprobs(self, req: Request, logits: torch.Tensor) -> None:
        """logits: one row per token of this step's chunk; the row at position p scores
        prompt token p + 1. Positions already collected (before a preemption) are skipped."""
        start = req.num_computed_tokens
        first = len(req.prompt_logprobs)  # next position to score
        end = min(start + logits.shape[0], len(req.prompt_ids) - 1)
        if end <= first:
            return
        targets = torch.tensor(req.prompt_ids[first + 1 : end + 1], device=logits.device)
        num_top = req.params.prompt_logprobs or 0
        chosen, top_ids, top_lps = token_logprobs(
            logits[first - start : end - start], targets, num_top
        )
        chosen_l = chosen.tolist()
        ids_l = top_ids.tolist() if top_ids is not None else [[] for _ in chosen_l]
        lps_l = top_lps.tolist() if top_lps is not None else [[] for _ in chosen_l]
        for token, lp, ids, lps in zip(targets.tolist(), chosen_l, ids_l, lps_l, strict=True):
            req.prompt_logprobs.append(TokenLogprob(token, lp, list(zip(ids, lps, strict=True))))

    def _sampling_metadata(self, reqs: list[Request]) -> SamplingMetadata:
        ps = [r.params for r in reqs]
        want = [p.logprobs for p in ps if p.logprobs is not None]
        return SamplingMetadata.build(
            temperature=[p.temperature for p in ps],
            top_k=[p.top_k for p in ps],
            top_p=[p.top_p for p in ps],
            min_p=[p.min_p for p in ps],
            presence_penalty=[p.presence_penalty for p in ps],
            frequency_penalty=[p.frequency_penalty for p in ps],
            repetition_penalty=[p.repetition_penalty for p in ps],
            logit_bias=[p.logit_bias for p in ps],
            suppress_ids=[
                sorted(self._tracked[r.request_id].stop_ids)
                if len(r.output_ids) < r.params.min_tokens
                else []
                for r in reqs
            ],
            prompt_ids=[r.prompt_ids for r in reqs],
            output_ids=[r.output_ids for r in reqs],
            generators=[r.generator for r in reqs],
            num_logprobs=max(want, default=-1),
            vocab_size=self.model.config.vocab_size,
            device=self.device,
        )

    def _append_tokens(
        self, reqs: list[Request], result: SamplerOutput, stats: StepStats
    ) -> list[RequestOutput]:
        now = time.monotonic()
        token_ids = result.token_ids.tolist()
        chosen_lp = result.logprobs.tolist() if result.logprobs is not None else None
        top_ids = result.top_ids.tolist() if result.top_ids is not None else None
        top_lp = result.top_logprobs.tolist() if result.top_logprobs is not None else None
        outputs = []
        for i, req in enumerate(reqs):
            try:
                logprob = None
                if chosen_lp is not None and req.params.logprobs is not None:
                    n = req.params.logprobs
                    top = (
                        list(zip(top_ids[i][:n], top_lp[i][:n], strict=False))
                        if top_ids and n
                        else []
                    )
                    logprob = TokenLogprob(token_ids[i], chosen_lp[i], top)
                outputs.append(self._append_one(req, token_ids[i], logprob, now, stats))
            except Exception:
                logger.exception("request %s: post-processing failed", req.request_id)
                outputs.append(self._fail(req, "internal error while processing the request"))
        return outputs

    def _append_one(
        self, req: Request, token: int, logprob: TokenLogprob | None, now: float, stats: StepStats
    ) -> RequestOutput:
        t = self._tracked[req.request_id]
        if req.first_token_time is None:
            req.first_token_time = now
            stats.ttft_s.append(now - req.arrival_time)
            # Once per client request, as its usage.prompt_tokens counts: the n sequences
            # of one request share a single prefill.
            if t.index == 0:
                stats.num_prompt_tokens += len(req.prompt_ids)
        else:
            stats.inter_token_s.append(now - (req.last_token_time or now))
        req.last_token_time = now
        req.append_output(token)
        stats.num_generated += 1
        if logprob is not None:
            t.pending_logprobs.append(logprob)

        params, done = req.params, len(req.output_ids) >= req.params.min_tokens
        reason = None
        if token in t.stop_ids and done:
            reason = "stop"
        elif t.text.add(token, check_stop=done):
            reason = "stop"
        elif len(req.output_ids) >= params.max_tokens:
            reason = "length"
        elif req.num_tokens >= self.scheduler.config.max_model_len:
            reason = "length"
        if reason is not None:
            t.text.finish()
            self.scheduler.finish(req, reason)
            stats.finished.append(self._finished_stats(req))
            self._forget(t)
        out = RequestOutput(
            request_id=t.group_id,
            index=t.index,
            new_token_ids=[token],
            new_text=t.text.take(final=reason is not None),
            finished=reason is not None,
            finish_reason=reason,
            logprobs=t.pending_logprobs or None,
            prompt_logprobs=(
                req.prompt_logprobs
                if params.prompt_logprobs is not None and len(req.output_ids) == 1
                else None
            ),
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
            num_cached_tokens=req.num_cached_tokens,
        )
        t.pending_logprobs = []
        return out

    def _fail(self, req: Request, message: str) -> RequestOutput:
        t = self._tracked.get(req.request_id)
        self.scheduler.finish(req, "error")
        if t is not None:
            self._forget(t)
        return RequestOutput(
            request_id=t.group_id if t else req.request_id,
            index=t.index if t else 0,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
            error=message,
        )

    def _forget(self, t: _Tracked) -> None:
        self._tracked.pop(t.request.request_id, None)
        group = self._groups.get(t.group_id)
        if group is not None and t.request.request_id in group:
            group.remove(t.request.request_id)
            if not group:
                del self._groups[t.group_id]

    def _finished_stats(self, req: Request) -> FinishedStats:
        now = time.monotonic()
        return FinishedStats(
            finish_reason=req.finish_reason or "stop",
            e2e_s=now - req.arrival_time,
            queue_s=(req.first_scheduled_time or now) - req.arrival_time,
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
        )

    def _fill_gauges(self, stats: StepStats) -> StepStats:
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_usage = self.kv.usage
        stats.kv_blocks_total = self.kv.num_blocks
        stats.prefix_cache_queries = self.kv.prefix_cache_queries
        stats.prefix_cache_hits = self.kv.prefix_cache_hits
        return stats


def create_engine(model: Llama, tokenizer: Tokenizer, config: EngineConfig | None = None) -> Engine:
    """Sizes the KV cache from the memory budget, allocates it and builds the engine."""
    config = config or EngineConfig()
    weight = model.embed_tokens.weight
    capacity = plan_kv_capacity(config, model.config, weight.dtype, weight.device)
    kv_cache = PagedKVCache.allocate(
        model.config, capacity.num_blocks, config.block_size, weight.dtype, weight.device
    )
    manager = KVCacheManager(capacity.num_blocks, config.block_size, config.enable_prefix_caching)
    sched = SchedulerConfig(
        max_model_len=capacity.max_model_len,
        max_num_seqs=config.max_num_seqs,
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_waiting=config.max_waiting,
    )
    return Engine(model, tokenizer, kv_cache, manager, sched)


def _needs_prompt_logits(req: Request) -> bool:
    """Whether this step's chunk holds prompt positions whose logprobs are still owed."""
    return (
        req.params.prompt_logprobs is not None
        and req.num_computed_tokens < len(req.prompt_ids) - 1
        and len(req.prompt_logprobs) < len(req.prompt_ids) - 1
    )

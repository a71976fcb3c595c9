"""`Engine.step()`: three calls, then the client's view of them. `scheduler.schedule()`
says what runs, `runner.execute()` computes and samples, `scheduler.update_from_output()`
moves requests forward; the engine then detokenizes, finds stop strings and turns each
sequence's news into a `RequestOutput`, with the step's metrics.

The engine owns what a client sees of a request (its id and n > 1 indices, its text, the
logprobs not yet sent, token timings). It never writes a request's lifecycle state (the
scheduler's) and never touches tensors (the runner's); it imports no torch.
Single-threaded and synchronous; `AsyncEngine` runs it on a background thread.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Protocol

from model.text.tokenizer import Tokenizer
from scheduler.engine.output_text import OutputText
from scheduler.lora_request import LoraRequest
from scheduler.request import Request, RequestOutput, TokenLogprob
from scheduler.sampling_params import SamplingParams
from scheduler.scheduler import Scheduler
from scheduler.stats import FinishedStats, StepStats
from scheduler.step_data import ModelRunnerOutput, SchedulerOutput, SequenceUpdate

logger = logging.getLogger(__name__)


class Runner(Protocol):
    """What the engine needs of a model runner (scheduler/runner/model_runner.py)."""

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput: ...


@dataclass
class _Sequence:
    """The client's view of one sequence: its request id and index, text, timings."""

    request: Request
    group_id: str
    index: int
    text: OutputText
    pending_logprobs: list[TokenLogprob] = field(default_factory=list)
    first_token_time: float | None = None
    last_token_time: float | None = None


class Engine:
    def __init__(self, runner: Runner, scheduler: Scheduler, tokenizer: Tokenizer) -> None:
        self.runner = runner
        self.scheduler = scheduler
        self.tokenizer = tokenizer
        self._sequences: dict[str, _Sequence] = {}
        self._groups: dict[str, list[str]] = {}
        # Aborts happen between steps; their stats ride on the next report.
        self._aborted: list[FinishedStats] = []

    # ---- admission -------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        lora: LoraRequest | None = None,
    ) -> None:
        """Queues a request, with the LoRA adapter `lora` if given; n > 1 becomes n
        sequences reported under the same id with indices 0..n-1. Raises InvalidParams or
        QueueFull, having queued nothing."""
        if request_id in self._groups:
            raise ValueError(f"request id {request_id!r} is already in use")
        stop_ids = frozenset(params.stop_token_ids)
        if not params.ignore_eos:
            stop_ids |= frozenset(self.tokenizer.stop_ids)
        seqs = []
        for index in range(params.n):
            # Seeds are 64-bit: the n-th sibling's seed wraps around, as torch itself wraps
            # negative seeds, instead of overflowing past 2**64 - 1.
            seed = None if params.seed is None else (params.seed + index) % 2**64
            request = Request(
                request_id if params.n == 1 else f"{request_id}#{index}",
                list(prompt_ids),
                params,
                stop_token_ids=stop_ids,
                seed=seed,
                lora=lora,
            )
            text = OutputText(
                self.tokenizer, request.prompt_ids, params.stop, params.skip_special_tokens
            )
            seqs.append(_Sequence(request, request_id, index, text))
        self.scheduler.add(seqs[0].request, [s.request for s in seqs[1:]])
        self._groups[request_id] = [s.request.request_id for s in seqs]
        for s in seqs:
            self._sequences[s.request.request_id] = s

    def abort(self, request_id: str) -> None:
        """Drops a request (all n sequences) and frees every block it holds."""
        for seq_id in self._groups.pop(request_id, []):
            req = self.scheduler.abort(seq_id)
            self._sequences.pop(seq_id, None)
            if req is not None:
                self._aborted.append(_finished_stats(req, "abort"))

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
        stats = StepStats(num_preemptions=len(plan.preempted_ids), finished=self._aborted)
        self._aborted = []
        result = self.runner.execute(plan)  # also when idle: it forgets what finished
        if not plan.scheduled:
            return [], self._fill_gauges(stats)
        stats.forward_s = result.forward_s
        stats.num_tokens = result.num_tokens
        if self.scheduler.speculator is not None:
            self.scheduler.speculator.observe(plan, result)
        updates = self.scheduler.update_from_output(plan, result)
        now = time.monotonic()
        outputs = []
        for update in updates:
            if update.request.finished and update.request.request_id not in self._sequences:
                continue  # a stop string ended it at a token before, in this same step
            try:
                outputs.append(self._output(update, now, stats))
            except Exception:
                logger.exception("request %s: post-processing failed", update.request.request_id)
                self.scheduler.finish(update.request, "error")
                outputs.append(
                    self._error_output(
                        update.request, "internal error while processing the request"
                    )
                )
        if self.scheduler.speculator is not None:
            stats.spec = self.scheduler.speculator.take_counts()
        stats.step_time_s = time.monotonic() - started
        return outputs, self._fill_gauges(stats)

    def _output(self, update: SequenceUpdate, now: float, stats: StepStats) -> RequestOutput:
        req = update.request
        if update.error is not None:
            return self._error_output(req, update.error)
        seq = self._sequences[req.request_id]
        token = update.token_id
        if seq.first_token_time is None:
            seq.first_token_time = now
            stats.ttft_s.append(now - req.arrival_time)
            # Once per client request, as its usage.prompt_tokens counts: the n sequences
            # of one request share a single prefill.
            if seq.index == 0:
                stats.num_prompt_tokens += len(req.prompt_ids)
        else:
            stats.inter_token_s.append(now - (seq.last_token_time or now))
        seq.last_token_time = now
        stats.num_generated += 1
        if update.logprob is not None:
            seq.pending_logprobs.append(update.logprob)

        reason = update.finish_reason
        # A stop token's own text is not part of the answer; any other token's text may
        # complete a stop string, which ends the request whatever the scheduler decided.
        if reason != "stop" and seq.text.add(token, check_stop=req.may_stop):
            reason = "stop"
            self.scheduler.finish(req, reason, update.num_output_tokens)
        if reason is not None:
            seq.text.finish()
            stats.finished.append(_finished_stats(req, reason))
            self._forget(seq)
        out = RequestOutput(
            request_id=seq.group_id,
            index=seq.index,
            new_token_ids=[token],
            new_text=seq.text.take(final=reason is not None),
            finished=reason is not None,
            finish_reason=reason,
            logprobs=seq.pending_logprobs or None,
            prompt_logprobs=(
                req.prompt_logprobs
                if req.params.prompt_logprobs is not None and len(req.output_ids) == 1
                else None
            ),
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=update.num_output_tokens,
            num_cached_tokens=req.num_cached_tokens,
        )
        seq.pending_logprobs = []
        return out

    def _error_output(self, req: Request, message: str) -> RequestOutput:
        seq = self._sequences.get(req.request_id)
        if seq is not None:
            self._forget(seq)
        return RequestOutput(
            request_id=seq.group_id if seq else req.request_id,
            index=seq.index if seq else 0,
            new_token_ids=[],
            new_text="",
            finished=True,
            finish_reason="error",
            num_prompt_tokens=len(req.prompt_ids),
            num_output_tokens=len(req.output_ids),
            error=message,
        )

    def _forget(self, seq: _Sequence) -> None:
        self._sequences.pop(seq.request.request_id, None)
        group = self._groups.get(seq.group_id)
        if group is not None and seq.request.request_id in group:
            group.remove(seq.request.request_id)
            if not group:
                del self._groups[seq.group_id]

    def _fill_gauges(self, stats: StepStats) -> StepStats:
        kv = self.scheduler.kv
        stats.num_running = len(self.scheduler.running)
        stats.num_waiting = self.scheduler.num_waiting
        stats.kv_usage = kv.usage
        stats.kv_blocks_total = kv.num_blocks
        stats.prefix_cache_queries = kv.prefix_cache_queries
        stats.prefix_cache_hits = kv.prefix_cache_hits
        adapters = getattr(self.runner, "adapters", None)
        stats.num_loras_resident = len(adapters.resident_names) if adapters is not None else 0
        return stats


def _finished_stats(req: Request, reason: str) -> FinishedStats:
    now = time.monotonic()
    return FinishedStats(
        finish_reason=reason,
        e2e_s=now - req.arrival_time,
        queue_s=(req.first_scheduled_time or now) - req.arrival_time,
        num_prompt_tokens=len(req.prompt_ids),
        num_output_tokens=len(req.output_ids),
        lora_name=req.lora.name if req.lora is not None else None,
    )

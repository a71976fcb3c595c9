"""`PoolingEngine`: the engine of a server whose model embeds. Each step takes waiting
inputs first come, first served, under the same limits generation steps keep (the step
token budget, `max_num_seqs`, the bounded waiting queue), runs them through a pooling
runner in one forward and answers each with its vector.

An input is computed whole in the step that takes it: an encoder attends in both
directions, so it cannot be cut into chunks, and nothing is kept once it is answered
(no KV blocks, no prefix cache). An input longer than the step budget runs in a step
of its own. It speaks `Engine`'s interface, so `AsyncEngine` drives either.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from scheduler.config import QueueFull, SchedulerConfig
from scheduler.request import RequestOutput
from scheduler.sampling_params import InvalidParams
from scheduler.stats import FinishedStats, StepStats

logger = logging.getLogger(__name__)


class PoolingRunner(Protocol):
    """What the engine needs of a pooling runner (scheduler/runner/pooling_runner.py)."""

    max_model_len: int
    dim: int

    def embed(
        self, token_ids: list[list[int]], token_type_ids: list[list[int]] | None = None
    ) -> np.ndarray:
        """[len(token_ids), dim] float32: one vector per input (a cross-encoder's: its
        scores). `token_type_ids`: each token's segment, None where no input has two."""
        ...


@dataclass(frozen=True)
class PoolingParams:
    """What a pooling request asks beyond its tokens: the segment of each token where the
    input is a text pair for a cross-encoder (empty: one segment); the route shapes the
    vector. `n` is there because `AsyncEngine` counts a request's sequences."""

    n: int = 1
    token_type_ids: tuple[int, ...] = ()


@dataclass
class _Input:
    request_id: str
    token_ids: list[int]
    token_type_ids: tuple[int, ...] = ()
    arrival_time: float = field(default_factory=time.monotonic)


class PoolingEngine:
    def __init__(self, runner: PoolingRunner, config: SchedulerConfig) -> None:
        self.runner = runner
        self.config = config
        self.waiting: deque[_Input] = deque()
        self._aborted: list[FinishedStats] = []

    def add_request(self, request_id: str, prompt_ids: list[int], params: PoolingParams) -> None:
        if len(self.waiting) >= self.config.max_waiting:
            raise QueueFull(f"the waiting queue is full ({self.config.max_waiting} requests)")
        if not prompt_ids:
            raise InvalidParams("input", "an input must have at least one token")
        if len(prompt_ids) > self.config.max_model_len:
            raise InvalidParams(
                "input",
                f"an input of {len(prompt_ids)} tokens is over the model's limit of "
                f"{self.config.max_model_len}",
            )
        if params.token_type_ids and len(params.token_type_ids) != len(prompt_ids):
            raise InvalidParams("input", "token_type_ids must give one segment per token")
        self.waiting.append(_Input(request_id, list(prompt_ids), params.token_type_ids))

    def abort(self, request_id: str) -> None:
        """Only waiting inputs can be aborted: a step runs start to end on this thread."""
        for item in [i for i in self.waiting if i.request_id == request_id]:
            self.waiting.remove(item)
            self._aborted.append(_finished(item, "abort"))

    def has_work(self) -> bool:
        return bool(self.waiting)

    def idle_stats(self) -> StepStats:
        stats = StepStats(finished=self._aborted, num_waiting=len(self.waiting))
        self._aborted = []
        return stats

    def step(self) -> tuple[list[RequestOutput], StepStats]:
        started = time.monotonic()
        taken = self._take()
        stats = StepStats(finished=self._aborted)
        self._aborted = []
        stats.num_running = len(taken)
        stats.num_tokens = sum(len(i.token_ids) for i in taken)
        try:
            types = None
            if any(i.token_type_ids for i in taken):
                types = [list(i.token_type_ids) or [0] * len(i.token_ids) for i in taken]
            vectors = self.runner.embed([i.token_ids for i in taken], types)
        except Exception:
            # A failure costs the inputs of this step, never the engine thread.
            logger.exception("embedding step of %d inputs failed", len(taken))
            outputs = [_output(i, None, "internal error while embedding the input") for i in taken]
        else:
            outputs = [_output(i, v) for i, v in zip(taken, vectors, strict=True)]
            now = time.monotonic()
            stats.num_prompt_tokens = stats.num_tokens
            for item in taken:
                stats.ttft_s.append(now - item.arrival_time)
                stats.finished.append(_finished(item, "stop", started))
        stats.forward_s = stats.step_time_s = time.monotonic() - started
        stats.num_waiting = len(self.waiting)
        return outputs, stats

    def _take(self) -> list[_Input]:
        """First come, first served, while the budget holds; never an empty step."""
        taken = [self.waiting.popleft()]
        tokens = len(taken[0].token_ids)
        while self.waiting and len(taken) < self.config.max_num_seqs:
            size = len(self.waiting[0].token_ids)
            if tokens + size > self.config.max_num_batched_tokens:
                break
            taken.append(self.waiting.popleft())
            tokens += size
        return taken


def _output(item: _Input, vector: np.ndarray | None, error: str | None = None) -> RequestOutput:
    return RequestOutput(
        request_id=item.request_id,
        new_token_ids=[],
        new_text="",
        finished=True,
        finish_reason="error" if error else "stop",
        num_prompt_tokens=len(item.token_ids),
        error=error,
        embedding=vector,
    )


def _finished(item: _Input, reason: str, scheduled: float | None = None) -> FinishedStats:
    now = time.monotonic()
    return FinishedStats(
        finish_reason=reason,
        e2e_s=now - item.arrival_time,
        queue_s=(scheduled or now) - item.arrival_time,
        num_prompt_tokens=len(item.token_ids),
        num_output_tokens=0,
    )

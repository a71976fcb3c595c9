"""`ModelRunner`: tensors in, tokens out. It turns a `SchedulerOutput` into a `Batch` and
sampling inputs, runs the forward and the sampler, and answers with plain per-request
results in a `ModelRunnerOutput`.

It owns every tensor-side decision: the KV-cache tensors and their size (device memory),
the attention backend the model was built with, and the seeded generators' draws.
It must never change request state: it reads the scheduler's plan and reports; the
scheduler alone moves requests forward. A failure costs only the sequences it touched,
never the engine thread.
"""

from __future__ import annotations

import logging
import threading
import time

import torch

from model.network.batch import Batch
from model.network.kv_int8 import cache_dtype
from model.network.llama import Llama
from model.network.paged_cache import PagedKVCache
from model.plan.tuning import config_key, remembered_for
from model.sampler import Sampler, position_seed
from scheduler.config import GPU_MAX_NUM_BATCHED_TOKENS, EngineConfig
from scheduler.runner.adapters import ResidentAdapters
from scheduler.runner.decode_graphs import DecodeGraphs
from scheduler.runner.draft_model import DraftModel
from scheduler.runner.inputs import build_step_inputs, sampling_metadata
from scheduler.runner.kv_capacity import plan_kv_capacity
from scheduler.runner.memory_profile import gpu_kv_budget
from scheduler.runner.openmp import release_openmp_workers
from scheduler.runner.step_results import (
    fail_sequences,
    prompt_logprobs,
    sampled_rows,
    sampled_tokens,
    verified,
)
from scheduler.step_data import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)

SMALL_STEP_TOKENS = 2


class ModelRunner:
    def __init__(self, model: Llama, config: EngineConfig, draft: Llama | None = None) -> None:
        """`draft`: a draft model for speculation (--speculative-config's "model"); its
        KV cache takes as many blocks as the target's, out of the same budget."""
        self.model = model
        self.device = model.device
        self.block_size = config.block_size
        self.sampler = Sampler(model.kernel_plan.argmax_kernel() if model.kernel_plan else None)
        # Ids a sequence may sample: a checkpoint's vocabulary is often padded past its
        # tokenizer's, and an id the tokenizer cannot decode must never be drawn.
        self.sample_vocab_size = model.config.vocab_size
        budget = None
        if self.device.type == "cuda" and config.kv_cache_memory is None:
            budget = gpu_kv_budget(
                model,
                self.sampler,
                config.max_num_batched_tokens or GPU_MAX_NUM_BATCHED_TOKENS,
                config.max_num_seqs,
                config.block_size,
                config.gpu_memory_utilization,
            )
        kv_dtype = cache_dtype(config.kv_cache_dtype, model.dtype)
        capacity = plan_kv_capacity(
            config, model.config, kv_dtype, model.device, budget, draft and draft.config
        )
        self.num_blocks = capacity.num_blocks
        self.max_model_len = capacity.max_model_len
        self.kv_cache = PagedKVCache.allocate(
            model.config, capacity.num_blocks, config.block_size, kv_dtype, model.device
        )
        if model.tp is not None:
            logger.info(
                "tensor parallel over %d ranks: each holds %d KV head(s) and %d KV blocks "
                "(%d tokens)",
                model.tp.size,
                model.config.n_kv_heads,
                self.num_blocks,
                self.num_blocks * self.block_size,
            )
        self.drafter = DraftModel(draft, capacity.num_blocks, config) if draft else None
        self.decode_graphs: DecodeGraphs | None = None
        # A graph would replay rank 0's collectives without the broadcast that brings the
        # other ranks to them: tensor-parallel steps run eagerly.
        if self.device.type == "cuda" and not config.enforce_eager and model.tp is None:
            if model.attention.supports_cuda_graphs:
                self.decode_graphs = DecodeGraphs(
                    model, self.kv_cache, config.max_num_seqs, self.max_model_len
                )
                self.decode_graphs.capture()
            else:
                logger.info(
                    "no CUDA graphs: the %s attention backend plans on the host",
                    model.attention.name,
                )
        # The thread count the operator chose (--threads), for steps worth parallelising;
        # small steps may run on fewer (measure_small_step_threads).
        self.max_threads = torch.get_num_threads()
        self.small_step_threads = self.max_threads
        self.adapters = ResidentAdapters.for_config(model, config)

    @property
    def vocab_size(self) -> int:
        return self.model.config.vocab_size

    def prefill_ms_per_token(self, num_tokens: int = 256) -> float:
        """Times one prefill chunk of `num_tokens` (after a smaller warm-up) in the first
        blocks of the cache, which no request holds yet at start-up. Never past the
        context length: the RoPE table holds no later position (`--max-model-len 160`
        had made start-up end in an IndexError)."""
        num_tokens = min(num_tokens, self.max_model_len)
        num_blocks = min(-(-num_tokens // self.block_size), self.num_blocks)
        num_tokens = min(num_tokens, num_blocks * self.block_size)
        table = list(range(num_blocks))
        tokens = [i % self.vocab_size for i in range(num_tokens)]

        def measure() -> float:
            warm = min(32, num_tokens)
            warm_up = Batch.build([tokens[:warm]], [0], [table], self.block_size, self.device)
            self.model(warm_up, self.kv_cache)
            batch = Batch.build([tokens], [0], [table], self.block_size, self.device)
            started = time.perf_counter()
            self.model(batch, self.kv_cache)
            return (time.perf_counter() - started) * 1e3 / num_tokens

        key = {"model": self._tuning_key(), "tokens": num_tokens}
        return remembered_for(self.model, "prefill_ms_per_token", key, measure)

    def _tuning_key(self) -> dict[str, object]:
        """What a step's speed depends on beside the thread count (model/plan/tuning.py): the
        model's shape, its weight format and kernels, and the block size."""
        modules = {f"{type(m).__name__}:{getattr(m, 'kernel', '')}" for m in self.model.modules()}
        return {
            "config": config_key(self.model.config),
            "modules": sorted(modules),
            "native_layers": sum(getattr(m, "native", None) is not None for m in self.model.layers),
            "attention": self.model.attention.name,
            "dtype": str(self.model.dtype),
            "block_size": self.block_size,
        }

    def execute(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        if not plan.scheduled:
            return ModelRunnerOutput()
        num_tokens = sum(len(req.new_token_ids) for req in plan.scheduled)
        threads = self._threads_for(num_tokens)
        if threads == torch.get_num_threads():
            return self._run(plan)
        # Set for this step only: the thread count is process-wide state.
        previous = torch.get_num_threads()
        torch.set_num_threads(threads)
        try:
            return self._run(plan)
        finally:
            torch.set_num_threads(previous)

    def _run(self, plan: SchedulerOutput) -> ModelRunnerOutput:
        result = ModelRunnerOutput()
        scheduled = plan.scheduled
        started = time.monotonic()
        try:
            if self.adapters is not None:
                scheduled = self.adapters.admit(plan, result)
                if not scheduled:
                    return result
            if self.drafter is not None:
                scheduled = self.drafter.fill(scheduled, self.sample_vocab_size, result)
            inputs = build_step_inputs(
                scheduled, self.block_size, self.kv_cache.null_block, self.device
            )
            if self.adapters is not None:
                inputs.batch.lora_slots = self.adapters.step_slots(scheduled)
            logits = self.forward(inputs.batch)
            result.forward_s = time.monotonic() - started
            result.num_tokens = inputs.batch.num_tokens
            for index, req in enumerate(scheduled):
                if req.prompt_logprobs_from is not None:
                    first = inputs.first_row[index]
                    rows = logits[first : first + inputs.num_rows[index]]
                    result.prompt_logprobs[req.request_id] = prompt_logprobs(req, rows)
        except Exception:
            if self.model.tp is not None:
                raise  # the ranks are out of step: nothing after this can be trusted
            logger.exception(
                "forward failed; failing the %d requests of this step", len(plan.scheduled)
            )
            fail_sequences(result, scheduled, "internal error in the model forward")
            return result

        indices = [i for i, req in enumerate(scheduled) if req.sample]
        sampling = [scheduled[i] for i in indices]
        if not sampling:
            return result
        try:
            vocab = self.sample_vocab_size
            # A speculating sequence samples a row per guess too (scheduler/spec/speculation.py),
            # each row as if it were the sequence's last.
            owners = [r for r in sampling for _ in range(1 + len(r.draft_token_ids))]
            generators = [
                self._generator(r, ahead)
                for r in sampling
                for ahead in range(1 + len(r.draft_token_ids))
            ]
            row_ids = [
                inputs.last_row(i) - len(scheduled[i].draft_token_ids) + j
                for i in indices
                for j in range(1 + len(scheduled[i].draft_token_ids))
            ]
            masks = [
                None if r.token_bitmask is None else r.token_bitmask[ahead]
                for r in sampling
                for ahead in range(1 + len(r.draft_token_ids))
            ]
            meta = sampling_metadata(owners, generators, vocab, self.device, masks)
            out = self.sampler(sampled_rows(logits, row_ids)[:, :vocab], meta)
            verified(sampling, sampled_tokens(owners, out), result)
        except Exception:
            # Only the rows that sampled are lost; an exception escaping the step would stop
            # the engine thread and with it every request on the server.
            logger.exception("sampling failed; failing the %d requests it held", len(sampling))
            fail_sequences(result, sampling, "internal error in the sampler")
        return result

    def forward(self, batch: Batch) -> torch.Tensor:
        if self.decode_graphs is not None and self.decode_graphs.fits(batch):
            return self.decode_graphs.run(batch)
        return self.model(batch, self.kv_cache)

    def measure_small_step_threads(self, reps: int = 4, rounds: int = 3) -> int:
        """A step of one or two tokens is hundreds of tiny ops, where every parallel region's
        fork and join may cost more than it saves, or not, depending on the CPU and the
        weight format. So this times a one-token step both ways on a thread of its own, as
        the engine runs (with the calling thread's OpenMP team released first, as the
        engine's start does: scheduler/runner/openmp.py), and keeps the faster; bigger
        steps always get every thread."""
        if self.device.type != "cpu" or self.max_threads == 1:
            return self.small_step_threads
        release_openmp_workers()

        def measure() -> dict[int, float]:
            timings: dict[int, float] = {}
            thread = threading.Thread(target=rounds_of, args=(timings,), name="llamaserve-measure")
            thread.start()
            thread.join()
            return timings

        def rounds_of(timings: dict[int, float]) -> None:
            batch = Batch.build([[0]], [self.block_size], [[0, 1]], self.block_size, self.device)
            # Alternating rounds, the best of each: one pass each way flipped the choice in
            # one start-up of four on a busy VM (a neighbour can only make a round slower).
            for _ in range(rounds):
                for threads in (self.max_threads, 1):
                    torch.set_num_threads(threads)
                    self.model(batch, self.kv_cache)  # warm-up
                    started = time.perf_counter()
                    for _ in range(reps):
                        self.model(batch, self.kv_cache)
                    ms = (time.perf_counter() - started) * 1e3 / reps
                    timings[threads] = min(timings.get(threads, ms), ms)
            torch.set_num_threads(self.max_threads)

        timings = remembered_for(
            self.model,
            "one_token_step_ms",
            {"model": self._tuning_key()},
            measure,
            decode=lambda stored: {int(n): ms for n, ms in stored.items()},
        )
        self.small_step_threads = min(timings, key=timings.get)
        logger.info(
            "one-token steps on %d thread(s): %s",
            self.small_step_threads,
            ", ".join(f"{n} thread(s) {ms:.1f} ms" for n, ms in timings.items()),
        )
        return self.small_step_threads

    def _threads_for(self, num_tokens: int) -> int:
        if self.device.type != "cpu":
            return torch.get_num_threads()
        return self.small_step_threads if num_tokens <= SMALL_STEP_TOKENS else self.max_threads

    def _generator(self, req: ScheduledRequest, ahead: int) -> torch.Generator | None:
        """A seeded sequence's draw for each output position comes from a generator seeded
        by its seed and that position alone, so its tokens depend only on the tokens before
        them: not on what shares the batch, nor on preemption, nor on how many positions a
        step verifies (speculation)."""
        if req.seed is None or req.params.greedy:
            return None
        generator = torch.Generator(device=self.device)
        generator.manual_seed(position_seed(req.seed, len(req.output_ids) + ahead))
        return generator

"""Tests for scheduler/scheduler.py on plain values, no model: `schedule()` plans and
`update_from_output()` alone moves requests forward (computed tokens, sampled tokens,
chunked prefill, forks of n > 1 siblings, stop tokens, lengths, errors, preemption), and
frees what finished. A fake runner answers with chosen tokens."""

from __future__ import annotations

import subprocess
import sys

import pytest

from scheduler.kv_cache import KVCacheManager
from scheduler.request import Request, RequestStatus, TokenLogprob
from scheduler.sampling_params import InvalidParams, SamplingParams
from scheduler.scheduler import QueueFull, Scheduler, SchedulerConfig
from scheduler.step_data import ModelRunnerOutput, SampledToken, SchedulerOutput

EOS = 2


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, budget: int = 64, max_model_len: int = 256
) -> Scheduler:
    config = SchedulerConfig(
        max_model_len=max_model_len,
        max_num_seqs=8,
        max_num_batched_tokens=budget,
        max_waiting=4,
    )
    return Scheduler(config, KVCacheManager(num_blocks, block_size))


def request(request_id: str, num_prompt: int = 10, base: int = 100, **params: object) -> Request:
    """A greedy request whose prompt is base, base + 1, ...: equal bases share a prefix."""
    return Request(
        request_id,
        list(range(base, base + num_prompt)),
        SamplingParams(temperature=0.0, **params),
        stop_token_ids=frozenset({EOS}),
    )


def answer(plan: SchedulerOutput, token: int = 7, **extra: object) -> ModelRunnerOutput:
    """What a runner returns: `token` for every sequence that samples this step."""
    sampled = {s.request_id: SampledToken(token, None) for s in plan.scheduled if s.sample}
    return ModelRunnerOutput(sampled=sampled, **extra)


def step(sched: Scheduler, token: int = 7) -> tuple[SchedulerOutput, list]:
    plan = sched.schedule()
    return plan, sched.update_from_output(plan, answer(plan, token))


def test_prefill_then_decode_advances_only_in_update_from_output() -> None:
    sched = make_scheduler()
    req = request("a", max_tokens=3)
    sched.add(req)
    plan = sched.schedule()
    (only,) = plan.scheduled
    assert only.new_token_ids == req.prompt_ids and only.num_computed_tokens == 0 and only.sample
    assert len(only.block_table) == 3  # 10 tokens in blocks of 4
    assert req.num_computed_tokens == 0 and req.output_ids == []  # schedule() moved nothing
    (update,) = sched.update_from_output(plan, answer(plan, token=7))
    assert (update.token_id, update.finish_reason) == (7, None)
    assert req.num_computed_tokens == 10 and req.output_ids == [7]

    plan, _ = step(sched, token=8)
    assert plan.scheduled[0].new_token_ids == [7] and plan.scheduled[0].num_computed_tokens == 10
    plan, (update,) = step(sched, token=9)
    assert update.finish_reason == "length" and req.output_ids == [7, 8, 9]
    assert req.status is RequestStatus.FINISHED and not sched.running
    assert sched.kv.num_used_blocks == 0


def test_chunked_prefill_samples_only_after_the_last_chunk() -> None:
    sched = make_scheduler(budget=4)
    req = request("a", num_prompt=10, max_tokens=2)
    sched.add(req)
    chunks = []
    for _ in range(3):
        plan, updates = step(sched)
        (s,) = plan.scheduled
        chunks.append((s.num_computed_tokens, len(s.new_token_ids), s.sample, len(updates)))
    assert chunks == [(0, 4, False, 0), (4, 4, False, 0), (8, 2, True, 1)]
    assert req.num_computed_tokens == 10 and req.output_ids == [7]


def test_stop_token_counts_only_after_min_tokens_and_is_suppressed_before() -> None:
    sched = make_scheduler()
    req = request("a", max_tokens=5, min_tokens=2)
    sched.add(req)
    plan = sched.schedule()
    assert plan.scheduled[0].suppress_token_ids == {EOS}
    (update,) = sched.update_from_output(plan, answer(plan, token=EOS))
    assert update.finish_reason is None  # a stop token before min_tokens does not stop
    plan = sched.schedule()
    assert plan.scheduled[0].suppress_token_ids == {EOS}
    sched.update_from_output(plan, answer(plan, token=5))
    plan = sched.schedule()
    assert plan.scheduled[0].suppress_token_ids == frozenset()
    (update,) = sched.update_from_output(plan, answer(plan, token=EOS))
    assert update.finish_reason == "stop" and req.finish_reason == "stop"
    assert sched.kv.num_used_blocks == 0


def test_siblings_fork_from_the_computed_prompt_and_share_its_full_blocks() -> None:
    sched = make_scheduler(block_size=4)
    first, siblings = request("r#0", num_prompt=10), [request("r#1"), request("r#2")]
    sched.add(first, siblings)
    assert sched.num_waiting == 3
    plan, _ = step(sched)
    assert [s.request_id for s in plan.scheduled] == ["r#0"]  # siblings wait for its prompt
    plan, _ = step(sched)
    by_id = {s.request_id: s for s in plan.scheduled}
    assert set(by_id) == {"r#0", "r#1", "r#2"}
    parent_table = by_id["r#0"].block_table
    for sibling in siblings:
        s = by_id[sibling.request_id]
        # (10 - 1) // 4 = 2 full blocks shared by reference; the rest is computed again.
        assert s.num_computed_tokens == 8 and s.new_token_ids == sibling.prompt_ids[8:]
        assert s.block_table[:2] == parent_table[:2] and s.block_table[2] != parent_table[2]
        assert sibling.num_cached_tokens == 8
    assert sched.kv.num_used_blocks == 3 + 2 * 1


def test_a_parent_that_finishes_at_once_still_forks_its_siblings() -> None:
    sched = make_scheduler()
    first, sibling = request("r#0", max_tokens=1), request("r#1", max_tokens=1)
    sched.add(first, [sibling])
    _, (update,) = step(sched)
    assert update.finish_reason == "length"
    plan, (update,) = step(sched)
    assert plan.scheduled[0].request_id == "r#1" and plan.scheduled[0].num_computed_tokens == 8
    assert update.finish_reason == "length" and sched.kv.num_used_blocks == 0


def test_preemption_frees_the_newest_and_resumes_it_with_its_outputs() -> None:
    # 6 blocks of 2 tokens: two 5-token prompts take 3 each; the first decode that needs a
    # new block preempts the newest request.
    sched = make_scheduler(num_blocks=6, block_size=2)
    old = request("old", num_prompt=5, max_tokens=4)
    new = request("new", num_prompt=5, base=200, max_tokens=4)
    sched.add(old)
    sched.add(new)
    step(sched, token=11)
    step(sched, token=12)
    assert old.output_ids == [11, 12] and new.output_ids == [11, 12]
    plan, updates = step(sched, token=13)  # the 7th token of "old" needs a 4th block
    assert plan.preempted_ids == ["new"] and [s.request_id for s in plan.scheduled] == ["old"]
    assert new.status is RequestStatus.PREEMPTED and new.num_computed_tokens == 0
    assert new.output_ids == [11, 12] and sched.num_preemptions == 1
    while not old.finished:
        step(sched, token=13)
    plan, _ = step(sched, token=14)
    (resumed,) = plan.scheduled
    assert resumed.request_id == "new"
    # Recomputed from its prompt and output so far; its full blocks may be prefix hits.
    assert resumed.new_token_ids == new.all_token_ids[resumed.num_computed_tokens : 7]
    assert new.output_ids == [11, 12, 14] and new.num_computed_tokens == 7
    sched.kv.check_invariants()


def test_errors_finish_the_failed_sequences_and_free_their_blocks() -> None:
    sched = make_scheduler()
    a, b = request("a"), request("b", base=300)
    sched.add(a)
    sched.add(b)
    plan = sched.schedule()
    result = answer(plan)
    del result.sampled["b"]
    result.errors["b"] = "internal error in the sampler"
    updates = {u.request.request_id: u for u in sched.update_from_output(plan, result)}
    assert updates["b"].finish_reason == "error" and updates["b"].error.startswith("internal")
    assert b.finished and b.num_computed_tokens == 0
    assert updates["a"].token_id == 7 and not a.finished
    assert sched.kv.block_table("b") == [] and sched.kv.block_table("a") != []


def test_prompt_logprobs_are_owed_until_every_position_is_scored() -> None:
    sched = make_scheduler(budget=6)
    req = request("a", num_prompt=10, prompt_logprobs=0)
    sched.add(req)
    plan = sched.schedule()
    assert plan.scheduled[0].prompt_logprobs_from == 0
    chunk = [TokenLogprob(t, -1.0, []) for t in req.prompt_ids[1:7]]
    sched.update_from_output(plan, answer(plan, prompt_logprobs={"a": chunk}))
    plan = sched.schedule()
    assert plan.scheduled[0].prompt_logprobs_from == 6 and req.owes_prompt_logprobs
    rest = [TokenLogprob(t, -1.0, []) for t in req.prompt_ids[7:]]
    sched.update_from_output(plan, answer(plan, prompt_logprobs={"a": rest}))
    assert not req.owes_prompt_logprobs and len(req.prompt_logprobs) == 9
    assert sched.schedule().scheduled[0].prompt_logprobs_from is None


def test_admission_refuses_a_full_queue_and_an_oversized_request() -> None:
    sched = make_scheduler(max_model_len=16)
    with pytest.raises(InvalidParams, match="maximum context length is 16"):
        sched.add(request("long", num_prompt=10, max_tokens=7))
    for i in range(4):
        sched.add(request(f"r{i}", max_tokens=4))
    with pytest.raises(QueueFull):
        sched.add(request("one-too-many", max_tokens=4))


def test_abort_frees_its_blocks() -> None:
    sched = make_scheduler()
    sched.add(request("a"))
    step(sched)
    assert sched.kv.num_used_blocks > 0
    assert sched.abort("a").finish_reason == "abort"
    assert sched.kv.num_used_blocks == 0 and not sched.has_work()


def test_the_scheduler_and_the_engine_import_no_torch() -> None:
    code = (
        "import sys, scheduler.engine.engine, scheduler.scheduler, scheduler.engine.async_engine; "
        "print(any(m == 'torch' or m.startswith('torch.') for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""The pooling engine's scheduling: first come, first served under the step token budget
and `max_num_seqs`, the bounded queue, aborts, and a failing step that costs only its own
inputs. A runner that records what it was given stands in for the model: what is
checked is which inputs share a step, not the vectors."""

import numpy as np
import pytest

from model.encoder.bert import PADDING_SLACK, length_groups
from scheduler.engine.pooling_engine import PoolingEngine, PoolingParams
from scheduler.sampling_params import InvalidParams
from scheduler.scheduler import QueueFull, SchedulerConfig


class RecordingRunner:
    max_model_len = 100
    dim = 3

    def __init__(self, fail_on: int | None = None) -> None:
        self.steps: list[list[list[int]]] = []
        self.types: list[list[list[int]] | None] = []
        self.fail_on = fail_on

    def embed(
        self, token_ids: list[list[int]], token_type_ids: list[list[int]] | None = None
    ) -> np.ndarray:
        self.steps.append(token_ids)
        self.types.append(token_type_ids)
        if self.fail_on is not None and len(self.steps) == self.fail_on:
            raise RuntimeError("out of memory")
        # Each vector says which input it came from: its first token and its length.
        return np.array([[t[0], len(t), 0.0] for t in token_ids], np.float32)


def engine(runner: RecordingRunner, **limits: int) -> PoolingEngine:
    config = dict(max_model_len=100, max_num_seqs=3, max_num_batched_tokens=10, max_waiting=5)
    return PoolingEngine(runner, SchedulerConfig(**{**config, **limits}))


def run_all(e: PoolingEngine) -> list:
    outputs = []
    while e.has_work():
        outputs += e.step()[0]
    return outputs


def test_steps_keep_the_budget_and_the_order() -> None:
    runner = RecordingRunner()
    e = engine(runner)
    sizes = [4, 4, 4, 1, 1, 1, 1, 30]  # 30: over the budget, runs alone
    outputs = []
    for first, last in ((0, 5), (5, 8)):  # the second group arrives once the first is done
        for i in range(first, last):
            e.add_request(f"r{i}", [i] * sizes[i], PoolingParams())
        outputs += run_all(e)
    assert [[len(t) for t in step] for step in runner.steps] == [[4, 4], [4, 1, 1], [1, 1], [30]]
    assert [o.request_id for o in outputs] == [f"r{i}" for i in range(8)]
    for i, out in enumerate(outputs):
        assert out.finished and out.finish_reason == "stop"
        assert np.array_equal(out.embedding, [i, sizes[i], 0])
        assert out.num_prompt_tokens == sizes[i]


def test_admission_limits() -> None:
    e = engine(RecordingRunner(), max_waiting=2)
    with pytest.raises(InvalidParams):
        e.add_request("empty", [], PoolingParams())
    with pytest.raises(InvalidParams):
        e.add_request("long", [1] * 101, PoolingParams())
    e.add_request("a", [1], PoolingParams())
    e.add_request("b", [1], PoolingParams())
    with pytest.raises(QueueFull):
        e.add_request("c", [1], PoolingParams())


def test_token_types_reach_the_runner_only_where_an_input_has_them() -> None:
    """A cross-encoder's pairs carry their segments; a step of single texts passes none,
    and a single text beside a pair is all segment 0."""
    runner = RecordingRunner()
    e = engine(runner, max_num_batched_tokens=100)
    e.add_request("one", [1, 2], PoolingParams())
    run_all(e)
    e.add_request("pair", [5, 6, 7], PoolingParams(token_type_ids=(0, 0, 1)))
    e.add_request("text", [8, 9], PoolingParams())
    run_all(e)
    assert runner.types == [None, [[0, 0, 1], [0, 0]]]
    with pytest.raises(InvalidParams):
        e.add_request("bad", [1, 2], PoolingParams(token_type_ids=(0,)))


def test_abort_of_a_waiting_input() -> None:
    runner = RecordingRunner()
    e = engine(runner)
    e.add_request("keep", [1, 2], PoolingParams())
    e.add_request("drop", [3, 4], PoolingParams())
    e.abort("drop")
    assert [f.finish_reason for f in e.idle_stats().finished] == ["abort"]
    assert [o.request_id for o in run_all(e)] == ["keep"]
    assert runner.steps == [[[1, 2]]]


def test_a_failing_step_costs_only_its_inputs() -> None:
    e = engine(RecordingRunner(fail_on=1), max_num_seqs=2)
    for name in "abc":
        e.add_request(name, [1, 2], PoolingParams())
    outputs, stats = e.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("a", "error"), ("b", "error")]
    assert all(o.error and o.embedding is None for o in outputs)
    assert stats.finished == [] and stats.num_prompt_tokens == 0  # no success counted
    outputs, stats = e.step()
    assert [(o.request_id, o.finish_reason) for o in outputs] == [("c", "stop")]
    assert stats.num_prompt_tokens == 2 and stats.num_waiting == 0


def test_length_groups_bound_padding_and_cover_every_input() -> None:
    lengths = [5, 200, 6, 7, 190, 50, 5, 48, 1]
    groups = length_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for group in groups:
        sizes = [lengths[i] for i in group]
        assert len(sizes) * max(sizes) <= PADDING_SLACK * sum(sizes)
    assert [200, 190] in [sorted((lengths[i] for i in g), reverse=True) for g in groups]

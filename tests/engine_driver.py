"""Runs an `Engine` synchronously until it is idle and collects what each request got."""

from dataclasses import dataclass, field

from model.greedy import greedy_tokens
from model.loader import LoadedModel
from scheduler.config import EngineConfig
from scheduler.engine.engine import Engine
from scheduler.engine.factory import create_engine
from scheduler.lora_request import LoraRequest
from scheduler.request import RequestOutput
from scheduler.sampling_params import SamplingParams


@dataclass
class Collected:
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    finish_reason: str | None = None
    outputs: list[RequestOutput] = field(default_factory=list)


def run_engine(
    engine: Engine,
    requests: dict[str, tuple[list[int], SamplingParams]],
    max_steps: int = 10_000,
    loras: dict[str, LoraRequest] | None = None,
) -> tuple[dict[tuple[str, int], Collected], int]:
    """Returns results keyed by (request id, sequence index), and the preemption count.
    `loras`: the adapter of each request that has one."""
    for rid, (ids, params) in requests.items():
        lora = (loras or {}).get(rid)
        engine.add_request(rid, ids, params, *([lora] if lora else []))
    results: dict[tuple[str, int], Collected] = {}
    preemptions = 0
    for _ in range(max_steps):
        if not engine.has_work():
            break
        outputs, stats = engine.step()
        preemptions += stats.num_preemptions
        for out in outputs:
            c = results.setdefault((out.request_id, out.index), Collected())
            c.token_ids += out.new_token_ids
            c.text += out.new_text
            c.outputs.append(out)
            if out.finished:
                c.finish_reason = out.finish_reason
    else:
        raise AssertionError("engine did not finish")
    return results, preemptions


def assert_batch_invariant(
    loaded: LoadedModel, texts: list[list[int]], max_tokens: int, kv_tokens: int, label: str = ""
) -> None:
    """Each prompt's greedy tokens alone equal what it gets among the others: crowded, its
    prompt fed in 7-token chunks, and preempted (a cache of `kv_tokens` tokens)."""
    stop = loaded.tokenizer.stop_ids
    c = loaded.model.config
    token_bytes = c.n_layers * 2 * c.n_kv_heads * c.head_dim * loaded.model.dtype.itemsize
    alone = [list(greedy_tokens(loaded.model, ids, max_tokens, stop)) for ids in texts]
    scenarios = {
        "crowded": {},
        "chunked_prefill": {"max_num_batched_tokens": 7},
        "preemption": {"kv_cache_memory": kv_tokens * token_bytes},
    }
    for scenario, kwargs in scenarios.items():
        engine = create_engine(loaded.model, loaded.tokenizer, EngineConfig(**kwargs))
        params = SamplingParams(max_tokens=max_tokens, temperature=0.0)
        requests = {f"r{i}": (ids, params) for i, ids in enumerate(texts)}
        results, preemptions = run_engine(engine, requests)
        assert preemptions > 0 or scenario != "preemption", label
        for i in range(len(texts)):
            assert results[(f"r{i}", 0)].token_ids == alone[i], (label, scenario, i)

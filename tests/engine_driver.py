"""Runs an `Engine` synchronously until it is idle and collects what each request got."""

from dataclasses import dataclass, field

from scheduler.engine.engine import Engine
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

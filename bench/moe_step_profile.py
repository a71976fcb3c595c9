"""Where one decode step of a mixture of experts goes, part by part, at one stream: the
model loaded as the server loads it, one request decoding, each part of each layer timed
around its call (attention in the C decoder layer, the post-attention norm, the router,
the experts, the final norm and output projection, the sampler and the rest of the engine
step), the minimum over many steps, since other work on a shared machine only ever adds.

    python -m bench.moe_step_profile --model PATH [--steps 200]

Wall time (`perf_counter_ns`) and the calling thread's CPU time (`thread_time_ns`) of each
part; the C kernels' OpenMP team shares the products, so a part's wall time is the figure
that counts, and its thread time shows how much of it this thread computed. Also a copy
bandwidth on 2 threads (`torch.Tensor.copy_` of 256 MiB) to compare the weight bytes a
token reads with.
"""

from __future__ import annotations

import argparse
import logging
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from bench.loadgen import make_prompt
from model.loader import load_model
from model.native.layer import NativeDecoderLayer
from model.network.decoder_layer import DecoderLayer, RMSNorm
from model.network.llama import Llama
from model.network.moe import SparseMoE
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.runner.model_runner import ModelRunner
from scheduler.sampling_params import SamplingParams


class _Untimed:
    """The runner's one-token steps on every thread, untimed."""

    def apply(self) -> None:
        ModelRunner.measure_small_step_threads = lambda runner, *_: runner.small_step_threads


RUNNER_THREADS_UNTIMED = _Untimed()
Timings = dict[str, list[tuple[int, int]]]
Mode = dict[str, list[tuple[int, int]]]


def timed(timings: Timings, name: str, call: Callable) -> Callable:
    def wrapper(*args, **kwargs):
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        out = call(*args, **kwargs)
        timings[name].append((time.perf_counter_ns() - wall, time.thread_time_ns() - cpu))
        return out

    return wrapper


def instrument(timings: Timings) -> None:
    """Wraps each part's entry point (class attributes: every layer's instance takes them)."""
    parts = {
        (NativeDecoderLayer, "decode"): "attention (C layer)",
        (SparseMoE, "route"): "router (PyTorch)",
        (SparseMoE, "residual"): "moe total",
        (Llama, "_head"): "output projection",
        (Llama, "forward"): "forward",
    }
    for (owner, attr), name in parts.items():
        setattr(owner, attr, timed(timings, name, getattr(owner, attr)))
    native = __import__("model.native.moe", fromlist=["NativeMoeExperts"]).NativeMoeExperts
    native.add = timed(timings, "experts (C)", native.add)
    if hasattr(native, "layer"):
        native.layer = timed(timings, "moe layer (C)", native.layer)
    RMSNorm.forward = timed(timings, "norms", RMSNorm.forward)


def copy_bandwidth_gbs(reps: int = 20) -> float:
    src = torch.empty(256 << 20, dtype=torch.uint8).fill_(1)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - start)
    return 2 * src.numel() / best / 1e9  # read + write


def weight_bytes_per_token(model: Llama) -> dict[str, int]:
    """Bytes of weights one token reads: attention's, top-k experts' (the mean expert's
    bytes times k), the router's, the output projection's."""
    out: dict[str, int] = defaultdict(int)

    def nbytes(module: torch.nn.Module) -> int:
        return sum(t.numel() * t.element_size() for t in module.state_dict().values())

    for layer in model.layers:
        for name in ("qkv_proj", "o_proj"):
            out["attention"] += nbytes(getattr(layer, name))
        if layer.moe is not None:
            experts = layer.moe.experts
            out["experts"] += nbytes(experts) * layer.moe.top_k // len(experts)
            out["router"] += nbytes(layer.moe.router)
    out["output projection"] = nbytes(model.lm_head)
    return dict(out)


def set_router_in_c(model: Llama, in_c: bool) -> None:
    """The router and experts in the C layer's call (as served), or, as before that, the
    router in PyTorch and the experts in their own C call."""
    for layer in model.layers:
        experts = layer.moe.native if layer.moe is not None else None
        if layer.native is not None and experts is not None:
            layer.native.use_moe(experts if in_c else None, experts.pointer)
    DecoderLayer._moe_in_c_layer = lambda self: None  # keep the choice made here


def decode_steps(engine, prompt: list[int], params: SamplingParams, timings: Timings) -> Mode:
    """One request's decode steps, each part's per-step sums."""
    out: Mode = defaultdict(list)
    engine.add_request(f"p{id(out)}", prompt, params)
    while engine.has_work():
        for part in timings.values():
            part.clear()
        wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
        _, stats = engine.step()
        step = (time.perf_counter_ns() - wall, time.thread_time_ns() - cpu)
        if stats.num_tokens != stats.num_generated:  # a prefill chunk
            continue
        out["engine step"].append(step)
        for name, values in timings.items():
            if values:
                out[name].append((sum(w for w, _ in values), sum(c for _, c in values)))
                out[name + " (one call)"].append(min(values))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--rounds", type=int, default=6, help="requests of 64 tokens per mode")
    args = p.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # What `auto` picks on a quiet machine (its timings on a busy one pick other things):
    # bf16 activations, int4 where the file has 4 bits, the C kernels, 2 threads a step.
    loaded = load_model(
        args.model, dtype="bfloat16", quantization="int4", cpu_kernels="native", progress=False
    )
    model = loaded.model
    RUNNER_THREADS_UNTIMED.apply()
    engine = create_engine(model, loaded.tokenizer, EngineConfig(max_num_seqs=1))
    prompt = make_prompt(loaded.tokenizer, random.Random(11), 128)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    timings: Timings = defaultdict(list)
    instrument(timings)
    modes: dict[str, Mode] = {
        "router in PyTorch": defaultdict(list),
        "router in C": defaultdict(list),
    }
    for round_ in range(args.rounds):
        for name, mode in modes.items():  # interleaved: both see the same neighbours
            set_router_in_c(model, name == "router in C")
            for part, values in decode_steps(engine, prompt, params, timings).items():
                mode[part] += values
        report(modes, round_ + 1)
    print_bandwidth(model)
    parts_of_one_layer(model)


def parts_of_one_layer(model: Llama, reps: int = 300) -> None:
    """Layer 0's FFN parts at one row, each called alone: min wall time of `reps` calls,
    interleaved."""
    layer = model.layers[0]
    moe, norm = layer.moe, layer.post_attention_layernorm
    native = moe.native
    h = (torch.randn(1, model.config.dim) * 0.5).to(torch.bfloat16)
    x = norm(h)
    weights, ids = native.route(x)
    calls = {
        "post-attention norm (C kernel via PyTorch)": lambda: norm(h),
        "router, PyTorch route()": lambda: moe.route(x),
        "router, C route()": lambda: native.route(x),
        "experts, C add()": lambda: native.add(x, ids, weights, h),
        "norm + router + experts, C layer()": lambda: native.layer(h),
    }
    best = dict.fromkeys(calls, float("inf"))
    with torch.inference_mode():
        for _ in range(reps):
            for name, call in calls.items():
                start = time.perf_counter_ns()
                call()
                best[name] = min(best[name], time.perf_counter_ns() - start)
    for name, ns in best.items():
        print(f"{name:44s} {ns / 1e3:9.1f} us (min of {reps})")


def report(modes: dict[str, Mode], rounds: int) -> None:
    print(f"after {rounds} rounds; {torch.get_num_threads()} threads; ms, minimum over steps")
    names = sorted({n for mode in modes.values() for n in mode})
    print(f"{'part':34s}" + "".join(f"{m:>30s}" for m in modes))
    for name in names:
        cells = []
        for mode in modes.values():
            if name in mode:
                wall, cpu = min(mode[name], key=lambda t: t[0])
                cells.append(f"{wall / 1e6:12.3f} (thread {cpu / 1e6:7.3f})")
            else:
                cells.append(f"{'-':>30s}")
        print(f"{name:34s}" + "".join(f"{c:>30s}" for c in cells), flush=True)


def print_bandwidth(model: Llama) -> None:
    sizes = weight_bytes_per_token(model)
    total = sum(sizes.values())
    print("weights read per token: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))
    bandwidth = copy_bandwidth_gbs()
    print(
        f"total {total / 1e6:.1f} MB; copy bandwidth {bandwidth:.1f} GB/s (2 threads, min of 20) "
        f"-> {total / bandwidth / 1e6:.2f} ms a token at that rate"
    )


if __name__ == "__main__":
    main()

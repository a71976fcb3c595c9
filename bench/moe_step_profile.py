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
import random
import time
from collections import defaultdict
from collections.abc import Callable

import torch

from bench.loadgen import make_prompt
from model.loader import load_model
from model.native.layer import NativeDecoderLayer
from model.network.decoder_layer import RMSNorm
from model.network.llama import Llama
from model.network.moe import SparseMoE
from scheduler.config import EngineConfig
from scheduler.engine.factory import create_engine
from scheduler.sampling_params import SamplingParams

Timings = dict[str, list[tuple[int, int]]]


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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True)
    p.add_argument("--steps", type=int, default=200)
    args = p.parse_args()
    loaded = load_model(args.model, dtype="auto", quantization="auto", progress=False)
    model = loaded.model
    engine = create_engine(model, loaded.tokenizer, EngineConfig(max_num_seqs=1))
    prompt = make_prompt(loaded.tokenizer, random.Random(11), 128)
    params = SamplingParams(max_tokens=64, temperature=0.0, ignore_eos=True)
    timings: Timings = defaultdict(list)
    instrument(timings)
    step_times: list[tuple[int, int]] = []
    n_layers = len(model.layers)
    done, index = 0, 0
    while done < args.steps:
        engine.add_request(f"p{index}", prompt, params)
        index += 1
        first = True
        while engine.has_work():
            for part in timings.values():
                part.clear()
            wall, cpu = time.perf_counter_ns(), time.thread_time_ns()
            engine.step()
            step = (time.perf_counter_ns() - wall, time.thread_time_ns() - cpu)
            if first:  # the prefill
                first = False
                continue
            step_times.append(step)
            for name, values in timings.items():
                per_step = (sum(w for w, _ in values), sum(c for _, c in values))
                best[name] = min(best.get(name, per_step), per_step, key=lambda t: t[0])
                smallest = min(values, key=lambda t: t[0])
                best_call[name] = min(best_call.get(name, smallest), smallest)
                calls[name] = len(values)
            done += 1
    report(step_times, n_layers, model)


best: dict[str, tuple[int, int]] = {}
best_call: dict[str, tuple[int, int]] = {}
calls: dict[str, int] = {}


def report(step_times: list[tuple[int, int]], n_layers: int, model: Llama) -> None:
    step = min(step_times)
    print(f"{len(step_times)} decode steps, {torch.get_num_threads()} threads; minimum of each")
    print(
        f"{'part':28s} {'calls':>5s} {'per step ms':>12s} {'thread ms':>10s} {'min call us':>12s}"
    )
    print(f"{'engine step':28s} {1:5d} {step[0] / 1e6:12.2f} {step[1] / 1e6:10.2f}")
    for name, (wall, cpu) in sorted(best.items()):
        print(
            f"{name:28s} {calls[name]:5d} {wall / 1e6:12.2f} {cpu / 1e6:10.2f} "
            f"{best_call[name][0] / 1e3:12.1f}"
        )
    sizes = weight_bytes_per_token(model)
    total = sum(sizes.values())
    print("weights read per token: " + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items()))
    bandwidth = copy_bandwidth_gbs()
    print(
        f"total {total / 1e6:.1f} MB; copy bandwidth {bandwidth:.1f} GB/s (2 threads, min of 20) "
        f"-> {total / bandwidth / 1e6:.2f} ms a token at that rate; {n_layers} layers"
    )


if __name__ == "__main__":
    main()

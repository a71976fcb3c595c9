"""Two replicas of one thread each behind vllm-router, against one replica of two threads,
on the same cores and the same load, in `make bench`'s format:

    python -m bench.replica_bench [--scenarios be] [--seed 1]

On one 2-core machine replication cannot add cores: what it changes is how well they are
used (one process runs small operations on two threads, paying fork and join each time),
and what it costs (two copies of the weights, two schedulers, the router's hop) shows
here. Peak RSS of the fleet is the sum of every process's own peak.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from pathlib import Path

from bench.loadgen import RunStats, run_closed_loop
from bench.serve_bench import SCENARIOS, Scenario, cpu_description, make_prompts
from bench.servers import free_port, llamaserve_command, running


def tree_peak_rss(pid: int) -> int:
    """Sum of the peak resident memory of a process and all its descendants."""
    total = 0
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        for line in status.read_text().splitlines():
            if line.startswith("VmHWM:"):
                total += int(line.split()[1]) * 1024
    children = Path(f"/proc/{pid}/task/{pid}/children")
    if children.exists():
        total += sum(tree_peak_rss(int(c)) for c in children.read_text().split())
    return total


def run(scenario: Scenario, prompts: list[list[int]], model: Path, extra: list[str]) -> dict:
    results: dict[str, tuple[RunStats, int]] = {}
    extra = [f"--max-num-seqs={max(64, scenario.clients)}", *extra]
    port = free_port()
    with running("one-replica", llamaserve_command(model, port, 2, extra), port) as server:
        stats = asyncio.run(
            run_closed_loop(server.base_url, prompts, scenario.clients, scenario.max_tokens)
        )
        results["1 x 2 threads"] = (stats, tree_peak_rss(server.process.pid))
    port = free_port()
    fleet = [
        sys.executable, "-m", "bench.fleet", "--port", str(port),
        "--replicas", "2", "--threads", "1", "--policy", "power_of_two", "--", str(model), *extra,
    ]  # fmt: skip
    with running("fleet", fleet, port) as server:
        stats = asyncio.run(
            run_closed_loop(server.base_url, prompts, scenario.clients, scenario.max_tokens)
        )
        results["2 x 1 thread"] = (stats, tree_peak_rss(server.process.pid))
    return results


def main(argv: list[str] | None = None) -> None:
    from model.checkpoint.default_model import default_model_path_or_none
    from model.checkpoint.gguf_file import open_gguf
    from model.text.tokenizer_files import tokenizer_from_gguf

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", type=Path, default=None)
    p.add_argument("--scenarios", default="be")
    p.add_argument("--scale", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--llamaserve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    model = args.model or default_model_path_or_none()
    tokenizer = tokenizer_from_gguf(open_gguf(model).metadata)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"CPU: {cpu_description()}; model {model.name}; seed {seed}")
    for key in args.scenarios:
        scenario = SCENARIOS[key]
        prompts = make_prompts(tokenizer, scenario, seed + ord(key), args.scale)
        results = run(scenario, prompts, model, args.llamaserve_args)
        print(f"\n{scenario.describe()}")
        print(f"{'setup':<15}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
              f"{'peak RSS':>10}{'errors':>8}")  # fmt: skip
        for name, (s, rss) in results.items():
            print(
                f"{name:<15}{s.output_tok_s:>8.1f}{s.ttft_p50_s:>9.2f}s{s.ttft_p99_s:>7.2f}s"
                f"{s.itl_p50_s * 1e3:>7.0f}ms{s.itl_p99_s * 1e3:>6.0f}ms{rss / 2**30:>8.2f}GB"
                f"{s.num_errors:>8}"
            )
        (one, _), (two, _) = results.values()
        print(f"{'2x1 / 1x2':<15}{two.output_tok_s / one.output_tok_s:>7.2f}x")


if __name__ == "__main__":
    main()

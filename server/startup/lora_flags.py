"""The LoRA flags of `llamaserve serve`, named as vLLM names them: --enable-lora,
--lora-modules, --max-loras, --max-lora-rank; and the one check of what they may be
combined with."""

from __future__ import annotations

import argparse
import json
import os

from scheduler import EngineConfig


def add_lora_flags(p: argparse.ArgumentParser) -> None:
    defaults = EngineConfig()
    p.add_argument(
        "--enable-lora",
        action="store_true",
        help="serve LoRA adapters beside the base model (implied by --lora-modules); a "
        "request names one as its model",
    )
    p.add_argument(
        "--lora-modules",
        nargs="+",
        default=[],
        type=lora_module,
        metavar="NAME=PATH",
        help="adapters to serve from the start: NAME=PATH (a PEFT directory or a GGUF LoRA "
        'file) or vLLM\'s JSON form {"name": ..., "path": ...}',
    )
    p.add_argument(
        "--max-loras",
        type=int,
        default=4,
        help="adapters resident in memory at once, and running in one batch; the least "
        "recently used one is evicted and read again from disk when needed (default 4)",
    )
    p.add_argument(
        "--max-lora-rank",
        type=int,
        default=defaults.max_lora_rank,
        help=f"the largest rank an adapter may have (default {defaults.max_lora_rank})",
    )


def lora_module(text: str) -> tuple[str, str]:
    """NAME=PATH or {"name": NAME, "path": PATH} -> (NAME, PATH)."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return str(spec["name"]), str(spec["path"])
        except (ValueError, KeyError, TypeError):
            message = f"{text!r} is not {{'name': ..., 'path': ...}}"
            raise argparse.ArgumentTypeError(message) from None
    name, sep, path = text.partition("=")
    if not sep or not name or not path:
        raise argparse.ArgumentTypeError(f"{text!r} is not NAME=PATH")
    return name, path


def lora_refusal(args: argparse.Namespace) -> str | None:
    """Why these flags cannot serve adapters, in one sentence; None when they can."""
    if not (args.enable_lora or args.lora_modules):
        return None
    if args.max_loras < 1:
        return f"--max-loras must be at least 1, got {args.max_loras}"
    if args.max_lora_rank < 1:
        return f"--max-lora-rank must be at least 1, got {args.max_lora_rank}"
    if args.task == "embed":
        return "LoRA adapters serve text generation only, not --task embed"
    if args.tensor_parallel_size != 1:
        return "LoRA adapters are not served with tensor parallelism (-tp) yet"
    for name, path in args.lora_modules:  # before loading the model for nothing
        if not os.path.exists(path):
            return f"--lora-modules {name}={path}: no such file or directory"
    return None

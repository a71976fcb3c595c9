"""The flags of `llamaserve serve` for several models (repeated --model, --models-dir,
--models-config, --models-max, --idle-unload-s, --models-memory, --load-at-start), the
test of whether a command line asks for several, and the flags a model's own process
inherits from it: every serve flag but those that concern the front alone (where it
listens, its keys, its CORS) and those that choose the models.

With one model and none of these flags, `serve` runs in one process exactly as before.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence

from server.startup.memory_size import parse_memory_size

# What the front alone uses; a model's process gets its own address and key.
FRONT_ONLY = {
    "model", "models_dir", "models_config", "models_max", "idle_unload_s", "models_memory",
    "load_at_start", "models_load_timeout", "host", "port", "api_key", "api_key_file",
    "served_model_name", "allowed_origins", "metrics_require_api_key", "backlog",
}  # fmt: skip


def add_multimodel_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--models-dir",
        default=None,
        metavar="DIR",
        help="serve every GGUF file and checkpoint directory in DIR, each under its file or "
        "folder name (implies several-model serving: one process per loaded model)",
    )
    p.add_argument(
        "--models-config",
        default=None,
        metavar="TOML",
        help="a TOML file of [models.NAME] tables: `model` (path or PyPI name), `flags` "
        "(this model's own serve flags, e.g. max-model-len = 2048) and `load_at_start`",
    )
    p.add_argument(
        "--models-max",
        type=int,
        default=None,
        metavar="N",
        help="with several models: at most N loaded at once; the least recently used one with "
        "no request in flight is unloaded to make room (default: as many as memory allows)",
    )
    p.add_argument(
        "--idle-unload-s",
        type=float,
        default=None,
        metavar="SECONDS",
        help="with several models: unload a model no request has used for this long",
    )
    p.add_argument(
        "--models-memory",
        type=parse_memory_size,
        default=None,
        metavar="SIZE",
        help="with several models: the memory loaded models may hold together, each counted "
        "as its weights plus its KV cache plus a process (default: the memory available "
        "when the server starts)",
    )
    p.add_argument(
        "--load-at-start",
        action="store_true",
        help="with several models: load every model when the server starts instead of on "
        "its first request (up to --models-max)",
    )
    p.add_argument(
        "--models-load-timeout",
        type=float,
        default=600.0,
        metavar="SECONDS",
        help="with several models: how long a model may take to load (default 600)",
    )


def serves_several(args: argparse.Namespace) -> bool:
    return len(args.model or []) > 1 or bool(args.models_dir) or bool(args.models_config)


def inherited_flags(argv: Sequence[str], parser: argparse.ArgumentParser) -> tuple[str, ...]:
    """The words of `argv` (serve's, after the command) a model's process gets: each option
    with its values, as `parser` reads them, minus FRONT_ONLY and positionals."""
    by_option = {s: a for a in parser._actions for s in a.option_strings}
    kept: list[str] = []
    i = 0
    while i < len(argv):
        word = argv[i]
        i += 1
        if not word.startswith("-") or word == "--":
            continue  # the positional MODEL
        option, has_value, _ = word.partition("=")
        matches = [s for s in by_option if s == option] or [
            s for s in by_option if s.startswith(option)
        ]
        action = by_option[matches[0]]  # argparse already refused an unknown or ambiguous one
        values: list[str] = []
        if not has_value:
            count = _value_count(action.nargs)
            while i < len(argv) and (count is None or len(values) < count):
                if argv[i].startswith("-") and not _is_number(argv[i]):
                    break
                values.append(argv[i])
                i += 1
        if action.dest not in FRONT_ONLY:
            kept += [word, *values]
    return tuple(kept)


def _value_count(nargs: int | str | None) -> int | None:
    """How many words an option takes at most; None: as many as follow."""
    if nargs is None:
        return 1
    if nargs == "?":
        return 1
    if isinstance(nargs, int):
        return nargs
    return None  # "+", "*"


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True

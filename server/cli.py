"""`llamaserve` command line: `generate` (a greedy demo straight on the model) and,
when the HTTP server lands, `serve`.

Flags are named as vLLM names them where the concept is the same. Errors a user can
cause (a bad model path, an unsupported file) print one sentence and exit 2.
"""

from __future__ import annotations

import argparse
import logging
import sys

import torch

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
    return parser


def generate(args: argparse.Namespace) -> int:
    from model.greedy import greedy_tokens
    from model.loader import load_model
    from model.tokenizer import IncrementalDetokenizer

    loaded = load_model(args.model, device=args.device, dtype=DTYPES[args.dtype])
    tok = loaded.tokenizer
    if args.chat:
        if loaded.chat_template is None:
            print(f"llamaserve: {loaded.path} has no chat template", file=sys.stderr)
            return 2
        text = loaded.chat_template.render([{"role": "user", "content": args.prompt}])
        ids = tok.encode(text, allow_special=True)
    else:
        ids = tok.encode(args.prompt)
    detok = IncrementalDetokenizer(tok)
    for token in greedy_tokens(loaded.model, ids, args.max_tokens, tok.stop_ids):
        if token in tok.stop_ids:
            break
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0


def main(argv: list[str] | None = None) -> int:
    from model.loader import ModelFileError, UnsupportedModelError

    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        if args.command == "generate":
            return generate(args)
    except (ModelFileError, UnsupportedModelError) as exc:
        print(f"llamaserve: {exc}", file=sys.stderr)
        return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())

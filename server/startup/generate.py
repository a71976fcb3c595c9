"""`llamaserve generate`: a greedy continuation of one prompt, straight on the model,
printed as it is decoded; the quickest check that a checkpoint loads and talks sense.

It never starts the engine or the HTTP server, and never samples: the same prompt always
prints the same text.
"""

from __future__ import annotations

import argparse
import sys

from model.greedy import greedy_tokens
from model.text.detokenizer import IncrementalDetokenizer
from server.startup.config import ServeConfig
from server.startup.flags import model_settings
from server.startup.launch import load


def generate(args: argparse.Namespace) -> int:
    loaded = load(ServeConfig(**model_settings(args)))
    tok = loaded.tokenizer
    if args.chat:
        if loaded.chat_template is None:
            print(f"llamaserve: {loaded.path} has no chat template", file=sys.stderr)
            return 2
        messages = [{"role": "user", "content": args.prompt}]
        ids = loaded.chat_template.prompt_ids(messages, tok)
    else:
        # A raw prompt is the user's own: hand-written chat markup becomes control tokens.
        ids = tok.encode(args.prompt, allow_special=True)
    detok = IncrementalDetokenizer(tok)
    for token in greedy_tokens(loaded.model, ids, args.max_tokens, tok.stop_ids):
        if token in tok.stop_ids:
            break
        sys.stdout.write(detok.add(token))
        sys.stdout.flush()
    sys.stdout.write(detok.flush() + "\n")
    return 0

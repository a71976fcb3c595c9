"""The flags of `llamaserve serve` that split a model across ranks (torch.distributed), as
vLLM and torchrun name them; the rest are flags.py's."""

from __future__ import annotations

import argparse


def add_parallel_flags(p: argparse.ArgumentParser) -> None:
    """Tensor parallelism over torch.distributed, named as vLLM and torchrun name them."""
    p.add_argument(
        "-tp",
        "--tensor-parallel-size",
        type=int,
        default=1,
        help="ranks to split every layer across (default 1); on CUDA one GPU each",
    )
    p.add_argument("--nnodes", type=int, default=1, help="machines the ranks span (default 1)")
    p.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this machine's index; only node 0 serves HTTP (default 0)",
    )
    p.add_argument(
        "--master-addr",
        default="127.0.0.1",
        help="address of node 0, where the ranks meet (default 127.0.0.1)",
    )
    p.add_argument(
        "--master-port",
        type=int,
        default=None,
        help="port the ranks meet on (default: a free one on one machine, 29500 on several)",
    )
    p.add_argument(
        "--distributed-timeout",
        type=float,
        default=60.0,
        help="seconds to wait for every rank at start-up, and for any one step's "
        "collectives, before giving up with an error (default 60)",
    )

"""One rank of a tensor-parallel forward, as its own process (real torch.distributed over
gloo): loads its shard of a checkpoint, runs a fixed chunked prefill of three prompts and
a decode step on a paged cache, and rank 0 saves the logits of both steps.

    python -m tests.tp_forward MODEL[,MODEL...] OUT --rank R --world-size N --port P
"""

import argparse

import torch

from model.loader import load_model
from model.network.batch import Batch
from model.network.paged_cache import PagedKVCache
from model.parallel.distributed import DistributedSpec, close_distributed, init_distributed
from model.parallel.plan import TensorParallel

BLOCK = 16


def logits_of_fixed_steps(model, vocab_size: int) -> list[torch.Tensor]:
    """Step 1 prefills all of two prompts and the first 20 tokens of a third; step 2 sends
    the third's remaining 13 tokens beside one decode of each of the others."""
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, vocab_size, (n,), generator=g).tolist() for n in (5, 17, 33)]
    cache = PagedKVCache.allocate(model.config, 8, BLOCK, model.embed_tokens.weight.dtype)
    tables = [[0], [1, 2], [3, 4, 5]]
    first = Batch.build(
        [prompts[0], prompts[1], prompts[2][:20]],
        [0, 0, 0],
        tables,
        BLOCK,
        all_logits=True,
        null_block=cache.null_block,
    )
    second = Batch.build(
        [[1], [2], prompts[2][20:]], [5, 17, 20], tables, BLOCK, null_block=cache.null_block
    )
    return [model(first, cache), model(second, cache)]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("model", nargs="?", default=None)
    p.add_argument("out")
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--port", type=int, default=29500)
    args = p.parse_args()
    torch.set_num_threads(1)
    tp = None
    if args.world_size > 1:
        init_distributed(DistributedSpec(args.rank, args.world_size, master_port=args.port))
        tp = TensorParallel(args.rank, args.world_size)
    # Several checkpoints, comma-separated, share one start-up of the ranks.
    results = []
    for model in args.model.split(",") if args.model else [None]:
        loaded = load_model(model, dtype=torch.float32, progress=False, tp=tp)
        results.append(logits_of_fixed_steps(loaded.model, loaded.config.vocab_size))
    if args.rank == 0:
        torch.save(results if len(results) > 1 else results[0], args.out)
    if tp is not None:
        # Every rank tears gloo down together: a rank that left while rank 0 was still
        # saving once aborted in gloo's teardown ("terminate called without an active
        # exception").
        torch.distributed.barrier()
    close_distributed()


if __name__ == "__main__":
    main()

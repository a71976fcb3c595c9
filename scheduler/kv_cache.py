"""Paged KV-cache block allocator: the bookkeeping behind the model's KV tensors.

Owns every KV block id: the free list, reference counts, the prefix-cache table of full
blocks (automatic prefix caching with LRU eviction) and each request's block table. The
model's per-layer K/V tensors are shaped [num_blocks, block_size, n_kv_heads, head_dim];
token position p of a request lives at slot
block_table[p // block_size] * block_size + p % block_size.

It must never touch tensors, run the model or decide which request runs: the scheduler
asks, this answers with block ids or a refusal that changed nothing.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field


def _chain_hash(parent_hash: bytes, token_ids: tuple[int, ...]) -> bytes:
    # sha256 rather than hash(): the built-in tuple hash can be collided on purpose, and a
    # collided prefix hash would hand one prompt KV computed under another prompt's prefix.
    return hashlib.sha256(parent_hash + array("q", token_ids).tobytes()).digest()


def _check(condition: bool, message: str) -> None:
    # Explicit raise rather than assert, so the check survives `python -O`.
    if not condition:
        raise AssertionError(message)


@dataclass(slots=True)
class _Block:
    block_id: int
    ref_count: int = 0
    # Set while the block is in the prefix cache: its chain hash and the tokens it holds,
    # compared on every hit so that a hash collision can never return foreign tokens.
    block_hash: bytes | None = None
    token_ids: tuple[int, ...] | None = None


@dataclass(slots=True)
class _RequestBlocks:
    block_ids: list[int] = field(default_factory=list)
    # Chain hash of each leading full block. Kept per request because a block whose hash was
    # already cached elsewhere is not registered, yet later blocks still chain from its hash.
    block_hashes: list[bytes] = field(default_factory=list)
    # What the first block's hash chains from: empty for the base model, an adapter's salt
    # for a LoRA request (scheduler/lora_request.py), so their cached prefixes never meet.
    root: bytes = b""


class KVCacheManager:
    """Hands out KV blocks to requests, shares full blocks by content, evicts LRU."""

    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be at least 1, got {num_blocks}")
        if block_size < 1:
            raise ValueError(f"block_size must be at least 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        # Counted in prompt tokens, as vLLM does: hit rate = hits / queries.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self._blocks = [_Block(block_id) for block_id in range(num_blocks)]
        # Blocks holding nothing reusable; always taken before any cached block. A stack: the
        # block freed last is taken first, so on a CPU only as many blocks as were ever in
        # use at once have their pages resident (the KV tensors are lazily zeroed memory).
        self._free_block_ids: list[int] = list(reversed(range(num_blocks)))
        # Cached blocks nobody references, least recently freed first: still hittable, and
        # evicted from the front when the free list runs dry.
        self._evictable: OrderedDict[int, None] = OrderedDict()
        self._cached: dict[bytes, int] = {}
        self._requests: dict[str, _RequestBlocks] = {}

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_block_ids) + len(self._evictable)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def get_computed_blocks(
        self, request_id: str, token_ids: Sequence[int], cache_salt: bytes = b""
    ) -> int:
        """Attach the longest cached chain of full blocks of the prompt; tokens covered.

        Hit blocks leave the evictable pool, so num_free_blocks may drop: a caller that then
        cannot allocate the rest must free() the request to give them back.
        """
        if not self.enable_prefix_caching:
            return 0
        held = self._requests.get(request_id)
        if held is not None and held.block_ids:
            raise ValueError(f"request {request_id!r} already holds blocks")
        block_size = self.block_size
        request = _RequestBlocks(root=cache_salt)
        parent_hash = cache_salt
        # (n - 1) // block_size: the last prompt token must always be computed, because its
        # logits give the first output token.
        for index in range((len(token_ids) - 1) // block_size):
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            block_hash = _chain_hash(parent_hash, tokens)
            block_id = self._cached.get(block_hash)
            if block_id is None or self._blocks[block_id].token_ids != tokens:
                break
            block = self._blocks[block_id]
            if block.ref_count == 0:
                del self._evictable[block_id]
            block.ref_count += 1
            request.block_ids.append(block_id)
            request.block_hashes.append(block_hash)
            parent_hash = block_hash
        self._requests[request_id] = request
        num_hit_tokens = len(request.block_ids) * block_size
        self.prefix_cache_queries += len(token_ids)
        self.prefix_cache_hits += num_hit_tokens
        return num_hit_tokens

    def allocate_slots(
        self,
        request_id: str,
        token_ids: Sequence[int],
        num_computed_tokens: int,
        num_new_tokens: int,
        cache_salt: bytes = b"",
    ) -> bool:
        """Grow the block table to cover the tokens; False, changing nothing, if out of blocks."""
        request = self._requests.get(request_id)
        num_held = len(request.block_ids) if request is not None else 0
        num_tokens = num_computed_tokens + num_new_tokens
        num_needed = -(-num_tokens // self.block_size) - num_held
        if num_needed > self.num_free_blocks:
            return False
        if request is None:
            request = self._requests[request_id] = _RequestBlocks(root=cache_salt)
        for _ in range(num_needed):
            request.block_ids.append(self._take_block())
        if self.enable_prefix_caching:
            # Registered now, before this step's forward writes the KV, as vLLM does: the
            # tokens are known, and a request that hits these blocks within this step runs in
            # the same forward, where each layer writes K/V into the cache before attending.
            num_full_blocks = min(num_tokens, len(token_ids)) // self.block_size
            self._register_full_blocks(request, token_ids, num_full_blocks)
        return True

    def fork(self, parent_id: str, child_id: str, num_tokens: int) -> int:
        """Share the parent's full blocks within its first num_tokens (computed) tokens.

        Returns the tokens the child may skip: a multiple of block_size below num_tokens.
        """
        held = self._requests.get(child_id)
        if held is not None and held.block_ids:
            raise ValueError(f"request {child_id!r} already holds blocks")
        parent = self._requests.get(parent_id, _RequestBlocks())
        # The partial last block stays private: both requests will write into it.
        num_shared = max(0, min((num_tokens - 1) // self.block_size, len(parent.block_ids)))
        shared = parent.block_ids[:num_shared]
        for block_id in shared:
            self._blocks[block_id].ref_count += 1
        self._requests[child_id] = _RequestBlocks(
            shared, parent.block_hashes[:num_shared], parent.root
        )
        return num_shared * self.block_size

    def trim(self, request_id: str, num_tokens: int) -> None:
        """Release the blocks past those that hold the first num_tokens tokens: the slots
        of speculated tokens the model rejected. Those blocks were never full of known
        tokens, so none is in the prefix cache."""
        request = self._requests.get(request_id)
        if request is None:
            return
        keep = -(-num_tokens // self.block_size)
        for block_id in reversed(request.block_ids[keep:]):
            block = self._blocks[block_id]
            _check(block.block_hash is None, f"trimmed block {block_id} is cached")
            block.ref_count -= 1
            if block.ref_count == 0:
                self._free_block_ids.append(block_id)
        del request.block_ids[keep:]
        del request.block_hashes[keep:]

    def free(self, request_id: str) -> None:
        """Release every block of the request; unknown ids are ignored."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return
        # Tail first, so LRU eviction takes the deepest blocks of a chain before its root,
        # which more prompts share.
        for block_id in reversed(request.block_ids):
            block = self._blocks[block_id]
            block.ref_count -= 1
            if block.ref_count == 0:
                if block.block_hash is None:
                    self._free_block_ids.append(block_id)
                else:
                    self._evictable[block_id] = None

    def block_table(self, request_id: str) -> list[int]:
        """A copy of the request's block ids, in token order."""
        request = self._requests.get(request_id)
        return list(request.block_ids) if request is not None else []

    def reset_prefix_cache(self) -> None:
        """Forget every cached block nobody references (e.g. after swapping weights)."""
        for block_id in self._evictable:
            self._uncache(self._blocks[block_id])
            self._free_block_ids.append(block_id)
        self._evictable.clear()

    def check_invariants(self) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent; for tests."""
        free, evictable = set(self._free_block_ids), set(self._evictable)
        holders: dict[int, int] = {}
        for request_id, request in self._requests.items():
            block_ids = request.block_ids
            _check(len(set(block_ids)) == len(block_ids), f"{request_id!r} holds a block twice")
            _check(len(request.block_hashes) <= len(block_ids), f"{request_id!r} extra hashes")
            for block_id, block_hash in zip(block_ids, request.block_hashes, strict=False):
                cached_hash = self._blocks[block_id].block_hash
                _check(cached_hash in (None, block_hash), f"{request_id!r} hash mismatch")
            for block_id in block_ids:
                holders[block_id] = holders.get(block_id, 0) + 1
        _check(len(free) == len(self._free_block_ids), "a block is on the free list twice")
        _check(
            sorted([*free, *evictable, *holders]) == list(range(self.num_blocks)),
            "free, evictable and referenced blocks do not partition all blocks",
        )
        for block in self._blocks:
            block_id = block.block_id
            _check(block.ref_count == holders.get(block_id, 0), f"block {block_id}: bad ref_count")
            is_cached = block.block_hash is not None
            _check(
                (block_id in evictable) == (is_cached and block.ref_count == 0),
                f"block {block_id}: evictable must mean cached and unreferenced",
            )
            if is_cached:
                _check(self.enable_prefix_caching, "a block is cached with prefix caching off")
                _check(self._cached.get(block.block_hash) == block_id, f"block {block_id} stale")
                _check(
                    block.token_ids is not None and len(block.token_ids) == self.block_size,
                    f"cached block {block_id} does not hold a full block of tokens",
                )
            else:
                _check(block.token_ids is None, f"block {block_id} has tokens but no hash")
        num_cached = sum(block.block_hash is not None for block in self._blocks)
        _check(num_cached == len(self._cached), "prefix-cache entries without a block")

    def _take_block(self) -> int:
        if self._free_block_ids:
            block = self._blocks[self._free_block_ids.pop()]
        else:
            block_id, _ = self._evictable.popitem(last=False)
            block = self._blocks[block_id]
            self._uncache(block)
        block.ref_count = 1
        return block.block_id

    def _uncache(self, block: _Block) -> None:
        del self._cached[block.block_hash]
        block.block_hash = None
        block.token_ids = None

    def _register_full_blocks(
        self, request: _RequestBlocks, token_ids: Sequence[int], num_full_blocks: int
    ) -> None:
        block_size = self.block_size
        block_hashes = request.block_hashes
        parent_hash = block_hashes[-1] if block_hashes else request.root
        for index in range(len(block_hashes), num_full_blocks):
            tokens = tuple(token_ids[index * block_size : (index + 1) * block_size])
            block_hash = _chain_hash(parent_hash, tokens)
            block_hashes.append(block_hash)
            block = self._blocks[request.block_ids[index]]
            # A block already cached under the same hash keeps the entry; this one stays a
            # private duplicate and returns to the free list when released.
            if block.block_hash is None and block_hash not in self._cached:
                block.block_hash = block_hash
                block.token_ids = tokens
                self._cached[block_hash] = block.block_id
            parent_hash = block_hash

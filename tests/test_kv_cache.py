"""Tests for scheduler/kv_cache.py: allocation, prefix caching, and a
stateful property test that drives the allocator like a scheduler would and checks it
against a shadow model of what each block holds."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from model.network.batch import Batch
from scheduler import kv_cache
from scheduler.kv_cache import KVCacheManager


def production_slots(kv: KVCacheManager, request_id: str, start: int, end: int) -> list[int]:
    """The KV slots the engine writes positions [start, end) to: the runner's `Batch`."""
    batch = Batch.build([[0] * (end - start)], [start], [kv.block_table(request_id)], kv.block_size)
    return batch.slot_mapping.tolist()


# --- allocation ----------------------------------------------------------------------------


def test_allocate_then_free_returns_every_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    assert kv.allocate_slots("a", list(range(10)), 0, 10)
    assert kv.allocate_slots("b", list(range(5)), 0, 5)
    assert len(kv.block_table("a")) == 3 and len(kv.block_table("b")) == 2
    assert kv.num_used_blocks == 5 and kv.usage == 5 / 8
    kv.check_invariants()
    kv.free("a")
    kv.free("b")
    kv.free("b")  # a second free, and an unknown id, are no-ops
    kv.free("never-seen")
    assert kv.num_free_blocks == 8 and kv.num_used_blocks == 0 and kv.usage == 0.0
    kv.check_invariants()


def test_growing_allocates_only_when_a_block_boundary_is_crossed() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = list(range(9))
    assert kv.allocate_slots("a", tokens, 0, 3)
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", tokens, 3, 1)
    assert len(kv.block_table("a")) == 1
    assert kv.allocate_slots("a", tokens, 4, 1)
    assert len(kv.block_table("a")) == 2


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    assert kv.allocate_slots("a", list(range(12)), 0, 12)
    table_a = kv.block_table("a")
    assert not kv.allocate_slots("b", list(range(8)), 0, 8)
    assert kv.block_table("b") == [] and kv.num_free_blocks == 1
    assert not kv.allocate_slots("a", list(range(20)), 12, 8)
    assert kv.block_table("a") == table_a and kv.num_free_blocks == 1
    kv.check_invariants()
    assert kv.allocate_slots("b", list(range(4)), 0, 4)
    assert kv.num_free_blocks == 0


def test_the_block_freed_last_is_taken_first() -> None:
    # Uncached blocks are reused most recent first, so the pages of blocks never needed at
    # once are never touched.
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=False)
    kv.allocate_slots("x", list(range(4)), 0, 4)
    kv.allocate_slots("a", list(range(8)), 0, 8)
    assert (kv.block_table("x"), kv.block_table("a")) == ([0], [1, 2])
    kv.free("x")
    kv.allocate_slots("a", list(range(10)), 8, 2)
    assert kv.block_table("a") == [1, 2, 0]
    kv.free("a")
    kv.allocate_slots("b", list(range(4)), 0, 4)
    assert kv.block_table("b") == [1]  # a freed its tail first: 0, then 2, then 1


def test_production_slots_follow_the_block_table() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=4)
    kv.allocate_slots("x", list(range(4)), 0, 4)  # takes block 0
    kv.allocate_slots("a", list(range(8)), 0, 8)  # takes blocks 1, 2
    kv.free("x")
    kv.allocate_slots("a", list(range(10)), 8, 2)  # block 3: x's block 0 stays cached
    assert kv.block_table("a") == [1, 2, 3]
    assert production_slots(kv, "a", 2, 10) == [6, 7, 8, 9, 10, 11, 12, 13]
    assert production_slots(kv, "a", 9, 10) == [13]


# --- prefix caching ------------------------------------------------------------------------


def test_prefix_hit_after_free_reuses_the_blocks_and_counts_tokens() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = [5, 6, 7, 8, 9, 10, 11, 12, 13, 14]
    assert kv.get_computed_blocks("a", prompt) == 0
    assert kv.allocate_slots("a", prompt, 0, len(prompt))
    table_a = kv.block_table("a")
    kv.free("a")
    assert kv.num_free_blocks == 8  # cached blocks stay allocatable
    assert kv.get_computed_blocks("b", prompt) == 8
    assert kv.block_table("b") == table_a[:2]
    assert kv.num_free_blocks == 6  # hit blocks are referenced again
    assert (kv.prefix_cache_queries, kv.prefix_cache_hits) == (20, 8)
    kv.check_invariants()


def test_hit_stops_at_the_first_differing_block() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(13))
    kv.allocate_slots("a", prompt, 0, 13)
    differs_in_second_block = prompt[:4] + [99] + prompt[5:]
    assert kv.get_computed_blocks("b", differs_in_second_block) == 4
    # The hash chains through the parent, so matching later blocks do not hit on their own.
    differs_in_first_block = [99] + prompt[1:]
    assert kv.get_computed_blocks("c", differs_in_first_block) == 0


def test_a_hit_never_covers_the_whole_prompt() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(8))
    kv.allocate_slots("a", prompt, 0, 8)
    assert kv.get_computed_blocks("b", prompt) == 4
    assert kv.get_computed_blocks("c", prompt[:4]) == 0
    assert kv.get_computed_blocks("d", prompt + [8]) == 8


def test_hits_chain_through_a_duplicate_block_that_was_not_registered() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(12))
    kv.allocate_slots("a", prompt, 0, 8)
    kv.allocate_slots("b", prompt, 0, 12)  # first two blocks duplicate a's, third is new
    table_a, table_b = kv.block_table("a"), kv.block_table("b")
    assert kv.get_computed_blocks("c", prompt + [12]) == 12
    assert kv.block_table("c") == table_a[:2] + table_b[2:]
    kv.check_invariants()


def test_a_hash_collision_never_returns_foreign_tokens(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kv_cache, "_chain_hash", lambda parent_hash, token_ids: b"same")
    kv = KVCacheManager(num_blocks=8, block_size=4)
    kv.allocate_slots("a", [1, 2, 3, 4, 5], 0, 5)
    assert kv.get_computed_blocks("b", [9, 9, 9, 9, 5]) == 0
    assert kv.get_computed_blocks("c", [1, 2, 3, 4, 5]) == 4


def test_blocks_become_hittable_as_decoding_fills_them() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    tokens = [1, 2, 3]
    kv.allocate_slots("a", tokens, 0, 3)
    tokens.append(4)  # a sampled token fills the first block
    kv.allocate_slots("a", tokens, 3, 1)
    assert kv.get_computed_blocks("b", [1, 2, 3, 4, 5]) == 4


def test_fork_shares_full_blocks_by_reference() -> None:
    kv = KVCacheManager(num_blocks=8, block_size=4)
    prompt = list(range(10))
    kv.allocate_slots("parent", prompt, 0, 10)
    used = kv.num_used_blocks
    assert kv.fork("parent", "child", 10) == 8
    assert kv.block_table("child") == kv.block_table("parent")[:2]
    assert kv.num_used_blocks == used
    assert kv.fork("parent", "exact", 8) == 4  # one token is always left to compute
    kv.check_invariants()
    kv.free("parent")
    assert kv.num_used_blocks == 2  # still held by the children
    kv.free("child")
    kv.free("exact")
    assert kv.num_used_blocks == 0
    kv.check_invariants()


def test_lru_evicts_the_least_recently_freed_chain_tail_first() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", [1, 2, 3, 4], 0, 4)  # blocks 0, 1
    kv.allocate_slots("b", [5, 6, 7, 8], 0, 4)  # blocks 2, 3
    kv.free("a")
    kv.free("b")
    kv.allocate_slots("c", [9, 9], 0, 2)
    assert kv.block_table("c") == [1]  # a's tail: freed first, deepest block first
    assert kv.get_computed_blocks("a2", [1, 2, 3, 4, 0]) == 2
    assert kv.get_computed_blocks("b2", [5, 6, 7, 8, 0]) == 4
    kv.check_invariants()


def test_never_cached_blocks_are_taken_before_evicting() -> None:
    kv = KVCacheManager(num_blocks=3, block_size=2)
    kv.allocate_slots("a", [1, 2], 0, 2)  # block 0, cached once freed
    kv.allocate_slots("b", [3], 0, 1)  # block 1, partial: never cached
    kv.free("a")
    kv.free("b")
    kv.allocate_slots("c", [4, 5, 6, 7], 0, 4)
    assert sorted(kv.block_table("c")) == [1, 2]
    assert kv.get_computed_blocks("a2", [1, 2, 0]) == 2


def test_reset_prefix_cache_forgets_unreferenced_blocks() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    kv.allocate_slots("b", [7, 8, 9], 0, 3)
    kv.free("a")
    kv.reset_prefix_cache()
    assert kv.num_free_blocks == 2
    assert kv.get_computed_blocks("a2", [1, 2, 3]) == 0
    assert kv.get_computed_blocks("b2", [7, 8, 9]) == 2  # b still holds its block
    kv.check_invariants()


def test_prefix_caching_off_never_hits() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2, enable_prefix_caching=False)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    kv.free("a")
    assert kv.get_computed_blocks("b", [1, 2, 3]) == 0
    assert kv.prefix_cache_hits == 0
    kv.check_invariants()


def test_check_invariants_detects_a_double_free() -> None:
    kv = KVCacheManager(num_blocks=4, block_size=2)
    kv.allocate_slots("a", [1, 2, 3], 0, 3)
    kv._free_block_ids.append(kv.block_table("a")[0])
    with pytest.raises(AssertionError):
        kv.check_invariants()


# --- stateful property test ----------------------------------------------------------------

ALPHABET = st.integers(0, 2)  # few token values, so prompts share prefixes often
# Few enough that allocations mostly succeed; the blocks still run out often enough.
MAX_LIVE_REQUESTS = 4


@dataclass
class ShadowRequest:
    tokens: list[int]
    num_computed: int  # tokens whose KV the shadow forward has written
    num_allocated: int  # tokens the block table must cover


class KVCacheMachine(RuleBasedStateMachine):
    """Plays scheduler and model: admits, grows, forks, preempts and frees requests, and
    "writes" each token's KV into the slot the block table names, so a block handed out
    wrongly shows up as a request whose blocks hold KV computed for other tokens."""

    def __init__(self) -> None:
        super().__init__()
        self.kv: KVCacheManager | None = None
        self.requests: dict[str, ShadowRequest] = {}
        # Block id -> per offset, the tokens up to and including the one written there: a
        # token's KV depends on its whole prefix, so a block is only reusable by a request
        # whose tokens agree up to the end of the block.
        self.written: dict[int, list[tuple[int, ...] | None]] = {}
        self.prompts: list[list[int]] = []
        self.next_id = 0

    @initialize(
        num_blocks=st.integers(1, 24),
        block_size=st.sampled_from([1, 2, 4]),
        caching=st.booleans(),
    )
    def create(self, num_blocks: int, block_size: int, caching: bool) -> None:
        self.kv = KVCacheManager(num_blocks, block_size, enable_prefix_caching=caching)
        self.written = {block_id: [None] * block_size for block_id in range(num_blocks)}

    def admit_tokens(self, tokens: list[int], data: st.DataObject) -> None:
        """Look the prompt up, then (like a scheduler admitting it) allocate a first chunk."""
        kv = self.kv
        request_id = f"r{self.next_id}"
        self.next_id += 1
        self.prompts.append(tokens)
        num_hit = kv.get_computed_blocks(request_id, tokens)
        assert num_hit % kv.block_size == 0 and 0 <= num_hit < len(tokens)
        assert kv.enable_prefix_caching or num_hit == 0
        assert len(kv.block_table(request_id)) == num_hit // kv.block_size
        self.requests[request_id] = ShadowRequest(list(tokens), num_hit, num_hit)
        self.allocate_and_write(request_id, data)

    @precondition(lambda self: len(self.requests) < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), tokens=st.lists(ALPHABET, min_size=1, max_size=20))
    def admit(self, data: st.DataObject, tokens: list[int]) -> None:
        self.admit_tokens(tokens, data)

    @precondition(lambda self: self.prompts and len(self.requests) < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), suffix=st.lists(ALPHABET, max_size=6))
    def admit_with_a_seen_prefix(self, data: st.DataObject, suffix: list[int]) -> None:
        prompt = data.draw(st.sampled_from(self.prompts))
        cut = data.draw(st.integers(0, len(prompt)))
        tokens = prompt[:cut] + suffix
        if tokens:
            self.admit_tokens(tokens, data)

    def pick(self, data: st.DataObject) -> str:
        return data.draw(st.sampled_from(sorted(self.requests)))

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def engine_step(self, data: st.DataObject) -> None:
        """Some requests with tokens left to compute each get a chunk, as in one step."""
        for request_id in sorted(self.requests):
            request = self.requests[request_id]
            if request.num_computed < len(request.tokens) and data.draw(st.booleans()):
                self.allocate_and_write(request_id, data)

    def allocate_and_write(self, request_id: str, data: st.DataObject) -> None:
        kv = self.kv
        request = self.requests[request_id]
        num_new = data.draw(st.integers(1, len(request.tokens) - request.num_computed))
        num_tokens = request.num_computed + num_new
        tables_before = {rid: kv.block_table(rid) for rid in self.requests}
        free_before = kv.num_free_blocks
        num_needed = -(-num_tokens // kv.block_size) - len(tables_before[request_id])
        ok = kv.allocate_slots(request_id, list(request.tokens), request.num_computed, num_new)
        assert ok == (num_needed <= free_before), "refused with enough free blocks, or not"
        if not ok:
            assert kv.num_free_blocks == free_before
            assert {rid: kv.block_table(rid) for rid in self.requests} == tables_before
            return
        table = kv.block_table(request_id)
        assert table[: len(tables_before[request_id])] == tables_before[request_id]
        others = {b for rid, t in tables_before.items() if rid != request_id for b in t}
        # Written where production writes: the slots of the runner's Batch for this chunk.
        slots = production_slots(kv, request_id, request.num_computed, num_tokens)
        for position, slot in zip(range(request.num_computed, num_tokens), slots, strict=True):
            block_id, offset = divmod(slot, kv.block_size)
            assert block_id not in others, f"writing into block {block_id}, held by another"
            self.written[block_id][offset] = tuple(request.tokens[: position + 1])
        request.num_computed = num_tokens
        request.num_allocated = max(request.num_allocated, num_tokens)

    @precondition(lambda self: self.requests)
    @rule(data=st.data(), token=ALPHABET)
    def append_sampled_token(self, data: st.DataObject, token: int) -> None:
        self.requests[self.pick(data)].tokens.append(token)

    @precondition(lambda self: 0 < len(self.requests) < MAX_LIVE_REQUESTS)
    @rule(data=st.data(), suffix=st.lists(ALPHABET, max_size=3))
    def fork(self, data: st.DataObject, suffix: list[int]) -> None:
        kv = self.kv
        parent_id = self.pick(data)
        parent = self.requests[parent_id]
        if parent.num_computed == 0:
            return
        num_tokens = data.draw(st.integers(1, parent.num_computed))
        child_id = f"r{self.next_id}"
        self.next_id += 1
        num_shared = kv.fork(parent_id, child_id, num_tokens)
        assert num_shared == (num_tokens - 1) // kv.block_size * kv.block_size
        num_blocks = num_shared // kv.block_size
        assert kv.block_table(child_id) == kv.block_table(parent_id)[:num_blocks]
        tokens = parent.tokens[:num_tokens] + suffix
        self.requests[child_id] = ShadowRequest(tokens, num_shared, num_shared)

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def free(self, data: st.DataObject) -> None:
        request_id = self.pick(data)
        num_free_before = self.kv.num_free_blocks
        self.kv.free(request_id)
        self.kv.free(request_id)  # a second free must not release anything again
        del self.requests[request_id]
        assert self.kv.block_table(request_id) == []
        assert self.kv.num_free_blocks >= num_free_before

    @precondition(lambda self: self.requests)
    @rule(data=st.data())
    def preempt_and_readmit(self, data: st.DataObject) -> None:
        request_id = self.pick(data)
        tokens = self.requests.pop(request_id).tokens
        self.kv.free(request_id)
        self.admit_tokens(tokens, data)

    @precondition(lambda self: self.prompts)
    @rule()
    def reset_prefix_cache(self) -> None:
        num_free_before = self.kv.num_free_blocks
        self.kv.reset_prefix_cache()
        assert self.kv.num_free_blocks == num_free_before

    @precondition(lambda self: self.requests)
    @rule()
    def free_everything(self) -> None:
        for request_id in list(self.requests):
            self.kv.free(request_id)
        self.requests.clear()
        assert self.kv.num_free_blocks == self.kv.num_blocks
        assert self.kv.num_used_blocks == 0

    @invariant()
    def bookkeeping_matches_the_shadow(self) -> None:
        kv = self.kv
        if kv is None:
            return
        kv.check_invariants()
        held: set[int] = set()
        for request_id, request in self.requests.items():
            table = kv.block_table(request_id)
            held.update(table)
            assert len(table) == -(-request.num_allocated // kv.block_size)
            # Every computed token, hit or forked ones included, must sit where attention
            # reads it: its block-table entry.
            for position in range(request.num_computed):
                block_id = table[position // kv.block_size]
                stored = self.written[block_id][position % kv.block_size]
                assert stored == tuple(request.tokens[: position + 1]), (
                    f"{request_id} position {position}: block {block_id} holds KV of {stored}"
                )
        assert kv.num_used_blocks == len(held)
        assert kv.num_free_blocks == kv.num_blocks - len(held)
        assert kv.usage == len(held) / kv.num_blocks

    def teardown(self) -> None:
        if self.kv is None:
            return
        for request_id in list(self.requests):
            self.kv.free(request_id)
        assert self.kv.num_free_blocks == self.kv.num_blocks
        self.kv.check_invariants()


KVCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=50,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
TestKVCacheMachine = KVCacheMachine.TestCase


def test_a_cache_salt_keeps_prefixes_apart() -> None:
    """Blocks cached under one salt (a LoRA adapter's) are found under that salt only:
    two adapters never share a prefix's KV, a request for the same one does."""
    kv = KVCacheManager(num_blocks=16, block_size=4)
    tokens = list(range(13))
    assert kv.allocate_slots("a", tokens, 0, len(tokens), b"adapter-1")
    kv.free("a")
    assert kv.get_computed_blocks("base", tokens) == 0
    assert kv.get_computed_blocks("other", tokens, b"adapter-2") == 0
    assert kv.get_computed_blocks("same", tokens, b"adapter-1") == 12
    assert kv.fork("same", "sibling", len(tokens)) == 12
    assert kv.allocate_slots("sibling", tokens, 12, 1)
    kv.check_invariants()

"""`LoraRequest`: which LoRA adapter a request runs with, as a plain value that travels
from the server's adapter registry through the scheduler to the runner.

`lora_id` is unique per loaded adapter for the life of the process (loading a name again,
even from the same path, gives a new id): the runner keys its resident adapters by it,
and the prefix cache salts its block hashes with it, so two adapters never share a cached
prefix's KV. `path` goes with the request, so an adapter evicted from memory, or unloaded
by name while the request runs, is read back from disk for it. Nothing here imports torch.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol


@dataclass(frozen=True)
class LoraRequest:
    name: str
    lora_id: int
    path: str

    @property
    def cache_salt(self) -> bytes:
        """The root of this adapter's prefix-cache hash chains (the base's is empty)."""
        return hashlib.sha256(f"lora:{self.lora_id}".encode()).digest()


class WithAdapter(Protocol):
    lora: LoraRequest | None


def admits_adapter(
    lora: LoraRequest | None, running: Iterable[WithAdapter], max_loras: int
) -> bool:
    """Whether a request with adapter `lora` may join the `running` ones: at
    most `max_loras` adapters run at once, so every one of them stays resident
    (scheduler/runner/adapters.py); the queue waits in order, as it does for blocks."""
    if lora is None:
        return True
    ids = {r.lora.lora_id for r in running if r.lora is not None}
    return lora.lora_id in ids or len(ids) < max_loras

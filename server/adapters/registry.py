"""`AdapterRegistry`: the LoRA adapters this server answers to by name (--lora-modules,
then /v1/load_lora_adapter and /v1/unload_lora_adapter), each as the `LoraRequest` its
requests carry into the engine.

An adapter is read and checked against the base when its name is added, so a wrong one is
refused there in one sentence rather than failing requests later. Unloading only removes
the name: requests already running with it keep their path and finish; the engine drops
its weights from memory when the slot is wanted again.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

from model.config import ModelConfig
from model.lora import AdapterError, read_adapter
from scheduler import LoraRequest

logger = logging.getLogger(__name__)


@dataclass
class AdapterRegistry:
    base_config: ModelConfig
    base_name: str
    max_lora_rank: int

    def __post_init__(self) -> None:
        self._by_name: dict[str, LoraRequest] = {}
        self._next_id = 1
        self._lock = threading.Lock()

    def add(self, name: str, path: str) -> LoraRequest:
        """Reads and checks the adapter (AdapterError: why it cannot serve), then answers
        to `name`; a name in use is refused (ValueError)."""
        if not name or name == self.base_name:
            raise ValueError(f"the adapter name {name!r} is the base model's or empty")
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
        adapter = read_adapter(name, path, self.base_config, self.max_lora_rank)
        with self._lock:
            if name in self._by_name:
                raise ValueError(f"a LoRA adapter named {name!r} is already loaded")
            lora = LoraRequest(name, self._next_id, str(path))
            self._next_id += 1
            self._by_name[name] = lora
        logger.info(
            "LoRA adapter %s ready from %s (rank %d, %.1f MB)",
            name,
            path,
            adapter.max_rank,
            adapter.nbytes / 1e6,
        )
        return lora

    def remove(self, name: str) -> bool:
        with self._lock:
            removed = self._by_name.pop(name, None) is not None
        if removed:
            logger.info("LoRA adapter %s unloaded", name)
        return removed

    def get(self, name: str | None) -> LoraRequest | None:
        return self._by_name.get(name) if name is not None else None

    def adapters(self) -> list[LoraRequest]:
        with self._lock:
            return list(self._by_name.values())


__all__ = ["AdapterError", "AdapterRegistry"]

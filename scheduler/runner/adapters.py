"""`ResidentAdapters`: which LoRA adapters are in memory, in which slot of the model's
`LoraSlots` (model/lora/slots.py), and reading them from disk on demand.

At most --max-loras adapters are resident; when a step needs one that is not, the least
recently used one that no running request uses is evicted (the scheduler admits at most
--max-loras adapters among the running requests, so there always is one). An adapter is
read again from the path its request carries, so a request never fails because another
adapter was evicted, nor because its own name was unloaded while it ran.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

from model.lora import AdapterError, read_adapter
from model.lora.hooks import attach_lora
from model.lora.slots import LoraSlots
from model.network.llama import Llama
from scheduler.config import EngineConfig
from scheduler.lora_request import LoraRequest
from scheduler.step_data import ModelRunnerOutput, ScheduledRequest, SchedulerOutput

logger = logging.getLogger(__name__)


class ResidentAdapters:
    def __init__(self, model: Llama, max_loras: int, max_rank: int) -> None:
        self.config = model.config
        self.max_rank = max_rank
        kernel = None
        if model.device.type == "cuda":  # one launch pair per projection, no host sync
            from model.lora.triton_update import lora_update as kernel
        self.slots = LoraSlots(model.config, max_loras, max_rank, model.device, kernel)
        attach_lora(model, self.slots)
        self._resident: OrderedDict[int, int] = OrderedDict()  # lora id -> slot, LRU first
        self._names: dict[int, str] = {}  # lora id -> name, of the resident ones
        self.num_loads = 0

    @property
    def resident_names(self) -> list[str]:
        return sorted(self._names.values())

    @classmethod
    def for_config(cls, model: Llama, config: EngineConfig) -> ResidentAdapters | None:
        """None where adapters are off (--enable-lora not given)."""
        return cls(model, config.max_loras, config.max_lora_rank) if config.max_loras else None

    def admit(self, plan: SchedulerOutput, result: ModelRunnerOutput) -> list[ScheduledRequest]:
        """The step's sequences whose adapter is resident, reading the missing ones from
        disk; a sequence whose adapter cannot be read fails alone (in `result.errors`)."""
        errors = self._make_resident(plan.scheduled, plan.running_lora_ids)
        result.errors.update(errors)
        return [s for s in plan.scheduled if s.request_id not in errors]

    def _make_resident(
        self, scheduled: list[ScheduledRequest], running: frozenset[int]
    ) -> dict[str, str]:
        wanted = {s.lora.lora_id: s.lora for s in scheduled if s.lora is not None}
        failed: dict[int, str] = {}
        for lora_id, lora in wanted.items():
            try:
                self._ensure(lora, running | wanted.keys())
            except AdapterError as exc:
                logger.error("LoRA adapter %s could not be read: %s", lora.name, exc)
                failed[lora_id] = str(exc)
        return {
            s.request_id: failed[s.lora.lora_id]
            for s in scheduled
            if s.lora is not None and s.lora.lora_id in failed
        }

    def step_slots(self, scheduled: list[ScheduledRequest]) -> list[int] | None:
        """Each sequence's slot (-1: the base), None when no sequence has an adapter, so
        a step of base rows keeps every fast path."""
        if all(s.lora is None for s in scheduled):
            return None
        return [-1 if s.lora is None else self._resident[s.lora.lora_id] for s in scheduled]

    def _ensure(self, lora: LoraRequest, keep: frozenset[int] | set[int]) -> None:
        if lora.lora_id in self._resident:
            self._resident.move_to_end(lora.lora_id)
            return
        adapter = read_adapter(lora.name, lora.path, self.config, self.max_rank)
        taken = set(self._resident.values())
        free = [s for s in range(self.slots.max_loras) if s not in taken]
        if free:
            slot = free[0]
        else:
            victim = next((i for i in self._resident if i not in keep), None)
            if victim is None:
                raise AdapterError(f"LoRA adapter {lora.name!r}: every slot is in use")
            slot = self._resident.pop(victim)
            logger.info("LoRA adapter %s evicted for %s", self._names.pop(victim), lora.name)
        self.slots.load(slot, adapter)
        self._resident[lora.lora_id] = slot
        self._names[lora.lora_id] = lora.name
        self.num_loads += 1
        logger.info("LoRA adapter %s loaded into slot %d from %s", lora.name, slot, lora.path)

"""Which adapters the engine knows, which sit in the CPU pool, which occupy a batch slot.

Three tiers, as in vLLM and S-LoRA: the *registry* (every adapter name the server
accepts, with its path), a *CPU pool* of up to ``max_cpu_loras`` loaded adapters (LRU;
an evicted one is read from disk again when needed), and ``max_loras`` *resident slots*
in the model's stacked LoRA weights (LRU among the adapters the current batch does not
use). The scheduler never puts more than ``max_loras`` distinct adapters in one batch,
so :meth:`LoRAManager.activate` always finds room.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import LoRAError

if TYPE_CHECKING:
    from .adapter import LoRAAdapter

#: Loads an adapter from disk (validating it against the base model).
Loader = Callable[[str, str], "LoRAAdapter"]


@dataclass(frozen=True)
class LoRARequest:
    """The adapter a request runs with (vLLM's LoRARequest: name, id, path).

    ``cache_key`` goes into the prefix-cache block hashes: the name the first time it is
    registered (so a router hashing the requested model name matches), ``name@N`` after
    the N-th re-registration, so blocks computed by an unloaded adapter of the same name
    are never reused.
    """

    name: str
    int_id: int
    path: str
    cache_key: str


class SlotTable:
    """``num_slots`` resident slots with LRU replacement among slots the batch does not use."""

    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # oldest use first
        self.loads = 0  # adapters brought into a slot, ever

    def assign(self, names: Iterable[str]) -> tuple[dict[str, int], list[tuple[str, int]]]:
        """Slots for ``names`` (at most ``num_slots`` distinct); also ``(name, slot)`` pairs
        newly brought in, whose weights the caller must write."""
        wanted = list(dict.fromkeys(names))
        if len(wanted) > self.num_slots:
            raise LoRAError(
                f"{len(wanted)} adapters in one batch, above --max-loras {self.num_slots}"
            )
        new: list[tuple[str, int]] = []
        for name in wanted:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self.slot_of if n not in wanted)
                slot = self.slot_of.pop(victim)
            self.slot_of[name] = slot
            new.append((name, slot))
            self.loads += 1
        return {n: self.slot_of[n] for n in wanted}, new

    def evict(self, name: str) -> int | None:
        return self.slot_of.pop(name, None)

    @property
    def resident(self) -> list[str]:
        return list(self.slot_of)


class LoRAManager:
    """Registry + CPU pool + slots. ``loader`` None = simulated mode (names only)."""

    def __init__(
        self,
        *,
        max_loras: int,
        max_lora_rank: int,
        max_cpu_loras: int | None = None,
        loader: Loader | None = None,
        write_slot: Callable[[int, LoRAAdapter | None], None] | None = None,
    ) -> None:
        if max_loras < 1:
            raise ValueError("--max-loras must be at least 1")
        if max_lora_rank < 1:
            raise ValueError("--max-lora-rank must be at least 1")
        cpu = max_cpu_loras if max_cpu_loras is not None else max_loras
        if cpu < max_loras:
            raise ValueError(f"--max-cpu-loras ({cpu}) must be at least --max-loras ({max_loras})")
        self.max_loras = max_loras
        self.max_lora_rank = max_lora_rank
        self.max_cpu_loras = cpu
        self.loader = loader
        self.write_slot = write_slot
        self.registry: dict[str, LoRARequest] = {}
        self.cpu: OrderedDict[str, LoRAAdapter] = OrderedDict()
        self.slots = SlotTable(max_loras)
        self._next_id = 1
        self.parents: dict[str, str] = {}  # adapter → base model name for /v1/models
        self._generations: dict[str, int] = {}

    def add(self, name: str, path: str) -> LoRARequest:
        """Register (and, with weights, load and validate) an adapter; LoRAError if bad."""
        if not name:
            raise LoRAError("a LoRA adapter needs a non-empty name")
        if name in self.registry:
            raise LoRAError(f"The lora adapter '{name}' has already been loaded.")
        if self.loader is not None:
            self._cache(self.loader(name, path))
        generation = self._generations.get(name, 0)
        self._generations[name] = generation + 1
        key = name if generation == 0 else f"{name}@{generation}"
        request = LoRARequest(name, self._next_id, str(Path(path)) if path else "", key)
        self._next_id += 1
        self.registry[name] = request
        return request

    def remove(self, name: str) -> None:
        if name not in self.registry:
            raise KeyError(name)
        del self.registry[name]
        self.cpu.pop(name, None)
        slot = self.slots.evict(name)
        if slot is not None and self.write_slot is not None:
            self.write_slot(slot, None)

    def get(self, name: str) -> LoRARequest | None:
        return self.registry.get(name)

    def activate(self, names: Iterable[str]) -> tuple[dict[str, int], list[str]]:
        """Make ``names`` resident; their slots, and the names that had to be loaded."""
        slots, new = self.slots.assign(names)
        for name, slot in new:
            if self.write_slot is not None:
                self.write_slot(slot, self._adapter(name))
        return slots, [name for name, _ in new]

    def _adapter(self, name: str) -> LoRAAdapter:
        adapter = self.cpu.get(name)
        if adapter is not None:
            self.cpu.move_to_end(name)
            return adapter
        assert self.loader is not None
        request = self.registry[name]
        return self._cache(self.loader(name, request.path))

    def _cache(self, adapter: LoRAAdapter) -> LoRAAdapter:
        self.cpu[adapter.name] = adapter
        self.cpu.move_to_end(adapter.name)
        while len(self.cpu) > self.max_cpu_loras:
            self.cpu.popitem(last=False)
        return adapter

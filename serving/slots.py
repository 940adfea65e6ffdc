"""KV-cache slot allocation: one slot id names a sequence's rows in both the target and mtp pools."""
from __future__ import annotations

import heapq


class SlotPool:
    """Free-list of slot ids `0..size-1`; the lowest free id is handed out first."""

    def __init__(self, size: int) -> None:
        if size <= 0:
            raise ValueError(f"max_slots: must be > 0, got {size}")
        self.size = size
        self._free = list(range(size))
        self._used: set[int] = set()

    def allocate(self) -> int | None:
        """A free slot id, or None when every slot is in use."""
        if not self._free:
            return None
        slot = heapq.heappop(self._free)
        self._used.add(slot)
        return slot

    def release(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} is not in use")
        self._used.remove(slot)
        heapq.heappush(self._free, slot)

    @property
    def num_free(self) -> int:
        return len(self._free)

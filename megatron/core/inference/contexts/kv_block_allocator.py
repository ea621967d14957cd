"""Fixed-size blocks of the paged KV cache: which are free, handed out and taken back per request."""

from typing import List


class KVBlockAllocator:
    """A free list over ``total_count`` block ids (``0 .. total_count - 1``), kept on the host: the scheduler
    decides on the host anyway, so allocation never synchronises with the device."""

    def __init__(self, total_count: int):
        if total_count < 1:
            raise ValueError(f"KVBlockAllocator needs at least one block, got total_count={total_count}")
        self.total_count = total_count
        # Popped from the end: the lowest ids are handed out first.
        self._free: List[int] = list(range(total_count - 1, -1, -1))

    @property
    def total_avail(self) -> int:
        return len(self._free)

    @property
    def total_used(self) -> int:
        return self.total_count - len(self._free)

    def is_memory_available(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate_memory_blocks(self, num_blocks: int) -> List[int]:
        """``num_blocks`` free block ids; ValueError if there are not that many (check first)."""
        if num_blocks > len(self._free):
            raise ValueError(f"KVBlockAllocator: {num_blocks} blocks asked for, {len(self._free)} free")
        taken = self._free[len(self._free) - num_blocks :][::-1]
        del self._free[len(self._free) - num_blocks :]
        return taken

    def release_memory_blocks(self, blocks: List[int]) -> None:
        """Give blocks back; a block released twice or never handed out is a bookkeeping bug and raises."""
        free = set(self._free)
        for block in blocks:
            if not 0 <= block < self.total_count or block in free:
                raise ValueError(f"KVBlockAllocator: block {block} released but it is not in use")
            free.add(block)
        # Kept sorted (highest first, popped from the end), so a batch admitted together gets consecutive,
        # evenly spaced blocks however the previous requests finished: the dynamic context then attends over a
        # view of the pool instead of gathering a copy.
        self._free.extend(blocks)
        self._free.sort(reverse=True)

    def reset(self) -> None:
        self._free = list(range(self.total_count - 1, -1, -1))

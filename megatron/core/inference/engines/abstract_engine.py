"""What an inference engine offers: generate text for prompts; and the per-request streams both engines feed."""

import asyncio
from abc import ABC, abstractmethod
from typing import AsyncGenerator, Dict, List, Tuple


class AbstractEngine(ABC):
    @abstractmethod
    def generate(self, *args, **kwargs) -> List:
        """Generate for the given prompts and return the finished requests."""


class RequestStreams:
    """Async streams of request snapshots, one or more per request: the engine pushes from whatever thread steps
    it, and each consumer reads on the event loop that opened its stream."""

    def __init__(self) -> None:
        self._queues: Dict[object, List[Tuple[asyncio.AbstractEventLoop, asyncio.Queue]]] = {}

    def expect(self, request_id) -> None:
        """Mark ``request_id`` as streamed before any consumer opens a stream for it."""
        self._queues.setdefault(request_id, [])

    def __contains__(self, request_id) -> bool:
        return request_id in self._queues

    def open(self, request_id) -> AsyncGenerator:
        """A new stream of ``request_id``'s snapshots, ending with the one pushed as finished. Call it on the
        event loop that consumes it."""
        queue: asyncio.Queue = asyncio.Queue()
        self._queues.setdefault(request_id, []).append((asyncio.get_running_loop(), queue))

        async def stream():
            while True:
                request, finished = await queue.get()
                yield request
                if finished:
                    return

        return stream()

    def push(self, request, finished: bool) -> None:
        """Hand every open stream of ``request`` a snapshot (a consumer may read it steps later); a finished
        request's streams end and are forgotten."""
        streams = self._queues.get(request.request_id, [])
        snapshot = request.snapshot() if streams else None
        for loop, queue in streams:
            loop.call_soon_threadsafe(queue.put_nowait, (snapshot, finished))
        if finished:
            self._queues.pop(request.request_id, None)

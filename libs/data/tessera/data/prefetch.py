"""Background prefetch: the next batches are prepared while the training step runs.

One thread drives the loader (tiktoken's encoder and shard reads release the GIL) and queues
up to `depth` batches, each with the loader state right after it, so `state_dict()` is the
state of the batches handed out, not of those prepared. With peers the loader's exchanges run
on that thread: give it peers of its own process group, not one the main thread also uses.

Stopping is collective-safe: the thread only stops when its queue is full, i.e. after exactly
`consumed + depth` batches on every rank, so no rank leaves a peer waiting in an exchange.
"""

from __future__ import annotations

import queue
import threading
from typing import Any

import torch

from tessera.data.loader import PackedLoader

_END = object()


class Prefetcher:
    """Iterator over `loader`'s batches prepared `depth` ahead; `pin_memory` pins them for
    faster host-to-GPU copies. Call `close()` before the process group goes away."""

    def __init__(self, loader: PackedLoader, depth: int, pin_memory: bool = False):
        if not isinstance(depth, int) or depth < 1:
            raise ValueError(f"prefetch depth must be a positive int, got {depth!r}")
        self.loader = loader
        self._pin = pin_memory
        self._state = loader.state_dict()
        self._queue: queue.Queue = queue.Queue(depth)
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._ended = False

    def __iter__(self) -> "Prefetcher":
        return self

    def __next__(self) -> tuple[torch.Tensor, torch.Tensor]:
        if self._ended:
            raise StopIteration
        if self._thread is None:
            self._stopping.clear()
            self._thread = threading.Thread(target=self._run, name="tessera-data-prefetch", daemon=True)
            self._thread.start()
        item = self._queue.get()
        if item is _END:
            self._ended = True
            raise StopIteration
        if isinstance(item, BaseException):
            self._ended = True
            raise item
        batch, self._state = item
        return batch

    def state_dict(self) -> dict[str, Any]:
        return self._state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.close()
        self.loader.load_state_dict(state)
        self._state = self.loader.state_dict()
        self._ended = False

    def realised_proportions(self) -> dict[str, float]:
        return self.loader.realised_proportions(self._state["window_index"])

    def close(self) -> None:
        """Stops the thread (after it fills its queue, see the module) and drops prepared batches."""
        if self._thread is None:
            return
        self._stopping.set()
        self._thread.join()
        self._thread = None
        while not self._queue.empty():
            self._queue.get_nowait()

    def _run(self) -> None:
        try:
            while True:
                try:
                    batch = next(self.loader)
                except StopIteration:
                    self._put(_END)
                    return
                if self._pin:
                    batch = tuple(t.pin_memory() for t in batch)
                if not self._put((batch, self.loader.state_dict())):
                    return
        except BaseException as e:  # handed to the consumer, raised there
            self._put(e)

    def _put(self, item: object) -> bool:
        """Queues `item`; False once stopping was asked and the queue is full."""
        while True:
            try:
                self._queue.put(item, timeout=0.05)
                return True
            except queue.Full:
                if self._stopping.is_set():
                    return False

"""Live tensor bytes of one process, counted at the dispatcher: every storage an op creates is
added when it appears and dropped when its last reference dies (a weakref callback). The same
counter runs under fake tensors (the estimate) and on real tensors (the measured run), so the two
count the same thing: tensor storage, not allocator caching or fragmentation. FSDP frees and
re-allocates its gathered weights by resizing storages, which the dispatcher does not see, so
`UntypedStorage.resize_` is wrapped while the counter is active (as torch's MemTracker does)."""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed._tools.common_utils import get_untyped_storages
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves


class LiveBytes(TorchDispatchMode):
    """`current` and `peak` bytes of the storages created while active;
    `peak_sizes` holds the storages live at the peak, so the peak can be split by owner."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: dict[int, int] = {}  # storage key -> bytes
        self._keys: dict[int, int] = {}  # storage address -> key; an address is reused once freed
        self._refs: dict[int, weakref.ref] = {}
        self._dropped = 0
        self.current = 0
        self.peak = 0
        self.peak_sizes: dict[int, int] = {}  # the storages live at the peak and their sizes then
        self._paused = 0

    def __enter__(self):
        self._resize = torch.UntypedStorage.resize_
        counter, original = self, self._resize

        def resize_(storage, size):
            original(storage, size)
            key = counter.key(storage)
            if key is not None:
                counter.current += storage.nbytes() - counter.sizes[key]
                counter.sizes[key] = storage.nbytes()
                counter._new_peak()
            else:
                counter._add(storage)

        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*exc)

    def key(self, storage: torch.UntypedStorage) -> int | None:
        """A live storage's key: unique over the run, unlike its address."""
        return self._keys.get(storage._cdata)

    @contextlib.contextmanager
    def uncounted(self):
        """Storages created inside are not counted: host memory (offloaded activations)."""
        self._paused += 1
        try:
            yield
        finally:
            self._paused -= 1

    def reset_peak(self) -> None:
        self.peak, self.peak_sizes = self.current, dict(self.sizes)

    def _track(self, t: torch.Tensor) -> None:
        for storage in get_untyped_storages(t):
            if self.key(storage) is None:
                self._add(storage)

    def _add(self, storage: torch.UntypedStorage) -> None:
        key = self._keys[storage._cdata] = len(self._refs) + self._dropped
        self.sizes[key] = storage.nbytes()
        self._refs[key] = weakref.ref(storage, lambda _, key=key, address=storage._cdata: self._drop(key, address))
        self.current += self.sizes[key]
        self._new_peak()

    def _new_peak(self) -> None:
        if self.current > self.peak:
            self.peak, self.peak_sizes = self.current, dict(self.sizes)

    def _drop(self, key: int, address: int) -> None:
        self.current -= self.sizes.pop(key, 0)
        self._refs.pop(key, None)
        self._dropped += 1
        if self._keys.get(address) == key:
            del self._keys[address]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_leaves(out) if not self._paused else ():
            if isinstance(t, torch.Tensor):
                self._track(t)
        return out

    def bytes_of(self, tensors, sizes: dict[int, int]) -> int:
        """Bytes `sizes` (a snapshot such as peak_sizes) gives `tensors`' storages, each once."""
        keys = {self.key(s) for t in tensors for s in get_untyped_storages(t)}
        return sum(sizes.get(k, 0) for k in keys)

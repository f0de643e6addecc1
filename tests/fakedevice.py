"""A fake device array for testing the GPU paths without a GPU.

The fake keeps its data in host memory (so MPI can read it when "CUDA-aware") but behaves like a
device array whose producer stream still has work queued: until ``synchronize`` (or the staging
copy, which synchronises) runs, the memory holds stale values.  Sending before synchronising would
therefore send stale data, and copying a staged receive back before completion would copy garbage.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from tensorplay_p2p._src.memory.devices import DeviceView

STALE = -7


class FakeDeviceArray:
    """A device-array stand-in whose queued "kernel" writes ``pending`` into it when the stream is synchronised."""

    def __init__(self, array: np.ndarray, pending: np.ndarray | None = None) -> None:
        self.array = array
        self.pending = pending

    def run_queued_work(self) -> None:
        if self.pending is not None:
            self.array[...] = self.pending
            self.pending = None

    def __getitem__(self, index: Any) -> FakeDeviceArray:
        return FakeDeviceArray(self.array[index])

    @property
    def T(self) -> FakeDeviceArray:  # noqa: N802
        return FakeDeviceArray(self.array.T)


class FakeAdapter:
    """Records each device step; copies are plain host copies."""

    def __init__(self) -> None:
        self.log: list[str] = []

    def view(self, a: FakeDeviceArray) -> DeviceView:
        arr = a.array
        return DeviceView(
            arr.__array_interface__["data"][0], arr.itemsize, arr.shape, arr.strides, arr.dtype.name, "fake:0"
        )

    def synchronize(self, a: FakeDeviceArray) -> None:
        self.log.append("synchronize")
        a.run_queued_work()

    def to_host(self, a: FakeDeviceArray, host: np.ndarray) -> None:
        self.log.append("to_host")
        a.run_queued_work()  # a staging copy is ordered after the queued work
        host[...] = np.ascontiguousarray(a.array).reshape(-1).view(np.uint8)

    def from_host(self, host: np.ndarray, a: FakeDeviceArray) -> None:
        self.log.append("from_host")
        a.array[...] = host.view(a.array.dtype).reshape(a.array.shape)

    def host_buffer(self, nbytes: int) -> np.ndarray:
        self.log.append("host_buffer")
        return np.empty(nbytes, dtype=np.uint8)

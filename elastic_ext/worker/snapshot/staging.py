"""Staging state in host memory before it is written: the writer sees CPU tensors only.

A commit copies the state into host buffers reused from one commit to the next (the
copy is the only part of a commit the training loop waits for; refilling a buffer
costs a memcpy, allocating a fresh one page faults as well). CUDA tensors go to
pinned buffers with non-blocking copies; the returned event says when they landed.

A keep (``stage_for_keep``) stages once, for a worker about to leave: CPU tensors as
they are (made contiguous), CUDA tensors copied on a side stream that does not wait
for the training stream, which may be stuck behind a hung collective, and within a
time limit. Either way the bytes written depend on the values only, not on the device
or the local rank that held them.
"""

from __future__ import annotations

import copy
import time
from typing import Any

import torch

from elastic_ext.worker.snapshot.tree import TreePath, map_tree


class HostStaging:
    """Copies a state tree into host buffers, one per tensor position in the tree."""

    def __init__(self) -> None:
        self._buffers: dict[TreePath, torch.Tensor] = {}
        self._used: set[TreePath] = set()
        self._cuda = False

    def capture(self, tree: Any) -> tuple[Any, torch.cuda.Event | None]:
        """A copy of ``tree`` in host memory, and the event to wait on before reading it."""
        self._used = set()
        self._cuda = False
        copied = map_tree(tree, self._copy_leaf)
        for key in list(self._buffers):
            if key not in self._used:
                del self._buffers[key]
        event = None
        if self._cuda:
            event = torch.cuda.Event()
            event.record()
        return copied, event

    def _copy_leaf(self, obj: Any, path: TreePath) -> Any:
        if isinstance(obj, torch.Tensor):
            return self._copy_tensor(obj, path)
        return copy.deepcopy(obj)

    def _copy_tensor(self, tensor: torch.Tensor, path: TreePath) -> torch.Tensor:
        t = tensor.detach()
        if t.layout != torch.strided or t.is_nested:
            return t.to("cpu", copy=True)
        buf = self._buffers.get(path)
        if buf is None or buf.shape != t.shape or buf.dtype != t.dtype:
            buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=t.is_cuda)
            self._buffers[path] = buf
        self._used.add(path)
        buf.copy_(t, non_blocking=t.is_cuda)
        self._cuda = self._cuda or t.is_cuda
        return buf


def stage_for_keep(tree: Any, timeout_s: float) -> Any:
    """``tree`` with every tensor on the host and contiguous (see the module docstring).

    Raises:
        TimeoutError: the device did not finish the copies within ``timeout_s``.
    """
    streams: dict[torch.device, torch.cuda.Stream] = {}
    events: list[torch.cuda.Event] = []

    def leaf(obj: Any, _path: TreePath) -> Any:
        if not isinstance(obj, torch.Tensor):
            return obj
        t = obj.detach()
        if not t.is_cuda:
            return t if t.is_contiguous() or t.layout != torch.strided else t.contiguous()
        if t.layout != torch.strided or t.is_nested:
            raise ValueError(f"cannot keep a {t.layout} CUDA tensor: convert it to a dense "
                             "tensor in state_dict()")
        stream = streams.get(t.device)
        if stream is None:
            stream = streams[t.device] = torch.cuda.Stream(device=t.device)
        buf = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
        with torch.cuda.stream(stream):
            buf.copy_(t, non_blocking=True)
        return buf

    staged = map_tree(tree, leaf)
    for stream in streams.values():
        event = torch.cuda.Event()
        event.record(stream)
        events.append(event)
    deadline = time.monotonic() + timeout_s
    while not all(event.query() for event in events):
        if time.monotonic() > deadline:
            raise TimeoutError(f"the device did not copy the state to host memory within "
                               f"{timeout_s:.1f}s")
        time.sleep(0.001)
    return staged


__all__ = ["HostStaging", "stage_for_keep"]

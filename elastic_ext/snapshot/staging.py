"""Host buffers a commit copies the state into, reused from one commit to the next.

The copy is the only part of a commit the training loop waits for. Refilling a
buffer costs a memcpy; allocating a fresh one costs page faults as well, several
times more on a large model. CUDA tensors go to pinned buffers with non-blocking
copies; the returned event says when they have landed.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from elastic_ext.snapshot.tree import TreePath, map_tree


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


__all__ = ["HostStaging"]

"""The payload file format: a small ``torch.save`` header, then the tensors' raw bytes.

The header is the state with every dense tensor replaced by a reference, plus a table
of dtypes and shapes; only CPU tensors are accepted (``staging.py`` moves them there), so
the bytes of a state never depend on the device or the strides that held it. Writing
raw bytes (``os.write`` underneath) and hashing them with ``hashlib`` releases the GIL
for all the heavy work, where ``torch.save`` copies each tensor into a Python ``bytes``
object and checksums it with the GIL held, which stalls the training thread.

Layout: magic, header length (8 bytes, little endian), header, then each tensor's
bytes, each starting at a multiple of 64 bytes from the start of the file.
"""

from __future__ import annotations

import io
import math
import os
from collections.abc import Mapping
from typing import Any

import torch

from elastic_ext.worker.snapshot.errors import SnapshotError
from elastic_ext.worker.snapshot.tree import TreePath, map_tree

PAYLOAD_MAGIC = b"EXTSNAP1"
_TENSOR_REF = "__elastic_ext_tensor__"
_ALIGN = 64
_WRITE_CHUNK = 8 << 20


def _holds_reserved_key(node: Any) -> bool:
    return isinstance(node, Mapping) and _TENSOR_REF in node


def _is_tensor_ref(node: Any) -> bool:
    return isinstance(node, Mapping) and set(node) == {_TENSOR_REF}


def _split_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The tree with each dense tensor replaced by ``{_TENSOR_REF: index}`` into ``tensors``."""

    def leaf(node: Any, _path: TreePath) -> Any:
        if _holds_reserved_key(node):
            raise ValueError(f"{_TENSOR_REF!r} is a reserved key")
        if isinstance(node, torch.Tensor) and node.device.type != "cpu":
            raise ValueError(f"a {node.device} tensor reached the snapshot writer: stage the "
                             "state in host memory first (staging.py); its bytes would name "
                             "the device")
        if isinstance(node, torch.Tensor) and node.layout == torch.strided \
                and not node.is_nested:
            # a view or a transposed tensor writes the bytes of its contiguous copy
            tensors.append(node if node.is_contiguous() else node.contiguous())
            return {_TENSOR_REF: len(tensors) - 1}
        return node  # sparse tensors and the like stay in the header, serialized by torch.save

    return map_tree(tree, leaf, is_leaf=_holds_reserved_key)


def _join_tensors(tree: Any, tensors: list[torch.Tensor]) -> Any:
    """The inverse of :func:`_split_tensors`: each reference replaced by its tensor."""

    def leaf(node: Any, _path: TreePath) -> Any:
        return tensors[int(node[_TENSOR_REF])] if _is_tensor_ref(node) else node

    return map_tree(tree, leaf, is_leaf=_is_tensor_ref)


def _byte_view(tensor: torch.Tensor) -> memoryview:
    return tensor.reshape(-1).view(torch.uint8).numpy().data


def _padding(offset: int) -> int:
    return -offset % _ALIGN


def write_payload(out: Any, payload: Mapping[str, Any]) -> None:
    """Write ``payload`` to ``out``, which needs only ``write``; see the module docstring."""
    tensors: list[torch.Tensor] = []
    skeleton = _split_tensors(dict(payload), tensors)
    table = [(str(t.dtype).removeprefix("torch."), tuple(t.shape)) for t in tensors]
    buffer = io.BytesIO()
    torch.save({"payload": skeleton, "tensors": table}, buffer)
    header = buffer.getvalue()
    offset = 0
    for part in (PAYLOAD_MAGIC, len(header).to_bytes(8, "little"), header):
        out.write(part)
        offset += len(part)
    for tensor in tensors:
        out.write(b"\0" * _padding(offset))
        offset += _padding(offset)
        view = _byte_view(tensor)
        for start in range(0, len(view), _WRITE_CHUNK):
            out.write(view[start:start + _WRITE_CHUNK])
        offset += len(view)


def _parse_header(raw: bytes, origin: str, weights_only: bool) -> dict[str, Any]:
    header = torch.load(io.BytesIO(raw), map_location="cpu", weights_only=weights_only)
    if not isinstance(header, dict) or "tensors" not in header or "payload" not in header:
        raise SnapshotError(f"{origin} has no valid payload header")
    return header


def _tensor_specs(header: Mapping[str, Any],
                  origin: str) -> list[tuple[torch.dtype, tuple[int, ...]]]:
    specs = []
    for dtype_name, shape in header["tensors"]:
        dtype = getattr(torch, dtype_name, None)
        if not isinstance(dtype, torch.dtype):
            raise SnapshotError(f"{origin} names an unknown dtype {dtype_name!r}")
        specs.append((dtype, tuple(shape)))
    return specs


def _finish(header: Mapping[str, Any], tensors: list[torch.Tensor]) -> dict[str, Any]:
    result = _join_tensors(header["payload"], tensors)
    assert isinstance(result, dict)
    return result


def map_payload(path: str | os.PathLike[str], size: int | None = None) -> torch.Tensor:
    """The file at ``path`` as a uint8 tensor mapped copy-on-write: the ranks of a node that
    load one file share its pages (one host copy per node, none in /dev/shm beyond the
    file itself). ``size``: the bytes its manifest says (SnapshotError if it is shorter)."""
    actual = os.path.getsize(path)
    if size is not None and actual < size:
        raise SnapshotError(f"{path} has fewer than the {size} bytes its manifest says")
    if actual == 0:
        raise SnapshotError(f"{path} is empty, not an elastic-ext snapshot payload")
    return torch.from_file(os.fspath(path), shared=False, size=size or actual, dtype=torch.uint8)


def load_payload(path: str | os.PathLike[str], *, weights_only: bool = True) -> dict[str, Any]:
    """Read a payload written by :func:`write_payload` (no checksum check: see ``verify``);
    its tensors are views of the file mapped copy-on-write (``map_payload``)."""
    return load_payload_buffer(map_payload(path), str(path), weights_only=weights_only)


def load_payload_buffer(buffer: torch.Tensor, origin: str, *,
                        weights_only: bool = True) -> dict[str, Any]:
    """The payload held in ``buffer`` (a 1-D uint8 CPU tensor, say one received from a
    peer); its tensors are views into ``buffer``, not copies."""
    data = buffer.numpy().data
    if bytes(data[:len(PAYLOAD_MAGIC)]) != PAYLOAD_MAGIC:
        raise SnapshotError(f"{origin} is not an elastic-ext snapshot payload")
    start = len(PAYLOAD_MAGIC) + 8
    length = int.from_bytes(bytes(data[len(PAYLOAD_MAGIC):start]), "little")
    header = _parse_header(bytes(data[start:start + length]), origin, weights_only)
    offset = start + length
    tensors = []
    for dtype, shape in _tensor_specs(header, origin):
        offset += _padding(offset)
        size = math.prod(shape) * dtype.itemsize
        if offset + size > len(data):
            raise SnapshotError(f"{origin} ends inside a tensor")
        tensors.append(buffer[offset:offset + size].view(dtype).reshape(shape))
        offset += size
    return _finish(header, tensors)


__all__ = ["PAYLOAD_MAGIC", "load_payload", "load_payload_buffer", "map_payload",
           "write_payload"]

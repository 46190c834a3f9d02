"""One rank's part of a sharded state as a flat buffer (issue #40): ``shards.plan_layout``
and ``shards.capture`` of a plain (non-DTensor) state dict in one process, the kept file's
round trip and its damage checks, and DCP loading the captured chunks back through
``metadata`` and ``MemoryReader``, bit-exact."""

from __future__ import annotations

import hashlib
import io
import json
import math
import struct
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp

from elastic_ext.worker.snapshot.memory_storage import MemoryReader
from elastic_ext.worker.snapshot.shards import (
    ShardSet,
    ShardSetDamagedError,
    capture,
    header_of,
    list_sets,
    metadata,
    parse_set_name,
    plan_layout,
    read_set,
    set_file_name,
    verify,
    with_digests,
    write_set,
)


def bits(t: torch.Tensor) -> bytes:
    return t.detach().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def tensors() -> dict[str, Any]:
    """Tensors of several dtypes and shapes (NaN payloads and -0.0 included), nested."""
    torch.manual_seed(0)
    return {"model": {"w": torch.randn(6, 3),
                      "b": torch.randn(5, dtype=torch.bfloat16),
                      "n": torch.tensor([float("nan"), float("-inf"), -0.0, 1e-45]),
                      "i": torch.arange(4, dtype=torch.int64) - 2,
                      "h": torch.tensor([[1, 2], [3, 4]], dtype=torch.int8),
                      "s": torch.tensor(2.5, dtype=torch.float64),
                      "e": torch.empty(0, 3)}}


REST = {"epoch": 3, "name": "run-7", "sizes": [1, 2, 3]}


def saved(obj: Any) -> bytes:
    blob = io.BytesIO()
    torch.save(obj, blob)
    return blob.getvalue()


def extras() -> dict[str, bytes]:
    """Values that are not tensors, serialized as a caller does (DCP unpickles them on
    load); one of an odd length, so that what follows it is not aligned by accident."""
    return {"rest": saved(REST), "odd": saved("x") + b"", "empty": b""}


TENSORS = {f"model.{k}": v for k, v in tensors()["model"].items()}


def blank() -> dict[str, Any]:
    """What a load fills in: the same structure, other values."""
    return {"model": {k: torch.full_like(v, 7) if v.numel() else torch.empty_like(v)
                      for k, v in tensors()["model"].items()},
            "rest": {}, "odd": ""}


def kept(state: dict[str, Any] | None = None, **kw: Any) -> ShardSet:
    layout = plan_layout(tensors() if state is None else state)
    options: dict[str, Any] = {"step": 42, "round_": 3, "world_size": 1, "owner": 0, **kw}
    return capture(layout, extras(), **options)


def quiet_load(target: dict[str, Any], reader: MemoryReader) -> None:
    """``dcp.load`` in one process, without its warning that no process group is there."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*assuming the intent is to load")
        dcp.load(target, storage_reader=reader, no_dist=True)


def load_back(sets: list[ShardSet]) -> dict[str, Any]:
    """``sets`` loaded into :func:`blank` by DCP, in one process, from their buffers."""
    chunks = {c.key: s.chunk_bytes(c) for s in sets for c in s.chunks}
    target = blank()
    quiet_load(target, MemoryReader(metadata(sets), chunks))
    return target


def assert_state_is(got: dict[str, Any], expected: dict[str, Any]) -> None:
    for name, tensor in expected["model"].items():
        assert got["model"][name].dtype == tensor.dtype, name
        assert got["model"][name].shape == tensor.shape, name
        assert bits(got["model"][name]) == bits(tensor), name
    assert got["rest"] == REST
    assert got["odd"] == "x"


# -- capture


def test_a_plain_state_is_captured_chunk_by_chunk_into_one_buffer() -> None:
    shards = kept()
    assert (shards.step, shards.round, shards.world_size, shards.owner) == (42, 3, 1, 0)
    keys = [c.key for c in shards.chunks]
    tensor_keys = [("model.b", (0,)), ("model.e", (0, 0)), ("model.h", (0, 0)),
                   ("model.i", (0,)), ("model.n", (0,)), ("model.s", ()), ("model.w", (0, 0))]
    # the tensors in DCP's order, then the extras by name
    assert keys == [*tensor_keys, ("empty", ()), ("odd", ()), ("rest", ())]
    # in order in the buffer, each start aligned, none overlapping, all inside it
    ends = 0
    for chunk in shards.chunks:
        assert chunk.start % 16 == 0 and chunk.start >= ends, chunk
        ends = chunk.start + chunk.length
    assert ends <= shards.nbytes < ends + 16
    assert shards.buffer.dtype == torch.uint8 and shards.buffer.device.type == "cpu"
    by_fqn = {c.key[0]: c for c in shards.chunks}
    for fqn, tensor in TENSORS.items():
        chunk = by_fqn[fqn]
        assert (chunk.dtype, chunk.sizes) == (str(tensor.dtype), tuple(tensor.shape)), fqn
        assert chunk.length == tensor.numel() * tensor.element_size(), fqn
        assert bits(shards.chunk_bytes(chunk)) == bits(tensor), fqn
        assert shards.tensors[fqn].dtype == str(tensor.dtype)
        assert shards.tensors[fqn].size == tuple(tensor.shape)
    assert by_fqn["model.e"].length == 0
    assert set(shards.tensors) == set(TENSORS)  # extras are not tensors
    for fqn, data in extras().items():
        assert (by_fqn[fqn].dtype, by_fqn[fqn].sizes) == (None, ())
        assert shards.chunk_bytes(by_fqn[fqn]).numpy().tobytes() == data
    assert shards.mappings["model.w"] == ("model", "w")
    assert all(c.sha256 == "" for c in shards.chunks)  # digests come later


def test_a_value_that_is_not_a_tensor_is_refused_naming_it() -> None:
    with pytest.raises(ValueError, match=r"extra\.epoch is not a tensor"):
        plan_layout({**tensors(), "extra": {"epoch": 3}})


def test_a_layout_reads_the_live_state_and_the_capture_is_a_copy_of_it() -> None:
    state = tensors()
    layout = plan_layout(state)
    state["model"]["w"].add_(1)  # a training step after the layout was planned: captured
    shards = capture(layout, extras(), step=1, round_=0, world_size=1, owner=0)
    assert bits(shards.chunk_bytes(next(c for c in shards.chunks if c.key[0] == "model.w"))) \
        == bits(state["model"]["w"])
    state["model"]["w"].add_(1)  # after the capture: not in it
    state["model"]["b"].zero_()
    expected = tensors()
    expected["model"]["w"].add_(1)
    assert_state_is(load_back([shards]), expected)


def test_a_non_contiguous_tensor_is_captured_as_it_is_at_capture_time() -> None:
    base = torch.zeros(2, 3)
    layout = plan_layout({"w": base.t()})
    base.fill_(5.0)
    shards = capture(layout, {}, step=1, round_=0, world_size=1, owner=0)
    assert bits(shards.chunk_bytes(shards.chunks[0])) == bits(base.t())


def test_digests_are_the_sha256_of_each_chunks_bytes() -> None:
    shards = kept()
    digested = with_digests(shards)
    assert digested.buffer is shards.buffer
    for chunk, plain in zip(digested.chunks, shards.chunks, strict=True):
        expected = hashlib.sha256(bits(shards.chunk_bytes(plain))).hexdigest()
        assert chunk.sha256 == expected
        assert chunk.key == plain.key and chunk.start == plain.start
    for name in ("model.e", "empty"):
        empty = next(c for c in digested.chunks if c.key[0] == name)
        assert empty.sha256 == hashlib.sha256(b"").hexdigest()


def test_capture_is_deterministic_so_copies_on_other_ranks_can_agree() -> None:
    first, second = with_digests(kept()), with_digests(kept())
    assert first.header() == second.header()


def test_a_buffer_large_enough_is_reused_and_a_smaller_one_is_not() -> None:
    first = kept()
    layout = plan_layout(tensors())
    for spare in (0, 1000):
        buffer = torch.full((first.nbytes + spare,), 9, dtype=torch.uint8)
        again = capture(layout, extras(), step=43, round_=3, world_size=1, owner=0,
                        buffer=buffer)
        assert again.buffer.data_ptr() == buffer.data_ptr()  # the same memory, no new one
        assert again.nbytes == first.nbytes
        assert_state_is(load_back([again]), tensors())
    small = torch.full((first.nbytes - 1,), 9, dtype=torch.uint8)
    other = capture(layout, extras(), step=44, round_=3, world_size=1, owner=0, buffer=small)
    assert other.buffer.data_ptr() != small.data_ptr() and other.nbytes == first.nbytes
    assert bool((small == 9).all())  # left alone
    assert kept().buffer.data_ptr() != first.buffer.data_ptr()  # none given: a new one


# -- the header and the kept file


def test_a_header_is_json_and_rebuilds_the_set_with_its_buffer() -> None:
    shards = with_digests(kept())
    data = json.loads(json.dumps(shards.header()))
    again = header_of(data, shards.buffer)
    assert again == shards


def test_a_header_that_does_not_fit_its_buffer_is_refused() -> None:
    shards = kept()
    with pytest.raises(ShardSetDamagedError, match="header says"):
        header_of(shards.header(), shards.buffer[:-1])
    with pytest.raises(ShardSetDamagedError, match="format 2"):
        header_of({**shards.header(), "format": 2}, shards.buffer)
    with pytest.raises(ShardSetDamagedError, match="malformed"):
        header_of({k: v for k, v in shards.header().items() if k != "chunks"}, shards.buffer)


def test_a_set_round_trips_through_its_file(tmp_path: Path) -> None:
    shards = with_digests(kept())
    path = write_set(tmp_path, shards)
    assert path == tmp_path / "shards-0000000042-w1-r0.bin" == tmp_path / shards.file_name()
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary file left
    back = read_set(path)
    assert back.header() == shards.header()
    assert torch.equal(back.buffer, shards.buffer)
    assert_state_is(load_back([back]), tensors())


def test_writing_a_set_again_replaces_the_file(tmp_path: Path) -> None:
    write_set(tmp_path, with_digests(kept(round_=1)))
    write_set(tmp_path, with_digests(kept(round_=2)))
    assert len(list(tmp_path.iterdir())) == 1
    assert read_set(tmp_path / set_file_name(42, 1, 0)).round == 2


@pytest.fixture
def written(tmp_path: Path) -> tuple[Path, bytes, int]:
    """A kept file, its bytes and where its buffer starts."""
    path = write_set(tmp_path, with_digests(kept()))
    raw = path.read_bytes()
    (length,) = struct.unpack_from("<Q", raw)
    return path, raw, 8 + length


def refused(path: Path, *patterns: str) -> str:
    with pytest.raises(ShardSetDamagedError) as err:
        read_set(path)
    message = str(err.value)
    assert str(path) in message, message
    for pattern in patterns:
        assert pattern in message, message
    return message


@pytest.mark.parametrize("keep", [0, 3, 8, 20], ids=lambda n: f"first-{n}-bytes")
def test_a_file_truncated_in_its_header_is_refused_naming_it(
        written: tuple[Path, bytes, int], keep: int) -> None:
    path, raw, _ = written
    path.write_bytes(raw[:keep])
    refused(path, "cannot be read as a kept shard set")


@pytest.mark.parametrize("cut", [1, 100], ids=lambda n: f"less-{n}-bytes")
def test_a_file_truncated_in_its_buffer_is_refused_naming_it(
        written: tuple[Path, bytes, int], cut: int) -> None:
    path, raw, _ = written
    path.write_bytes(raw[:-cut])
    refused(path, "header says")


def test_a_file_truncated_in_its_buffer_is_refused(written: tuple[Path, bytes, int]) -> None:
    path, raw, _ = written
    path.write_bytes(raw[:-1])
    with pytest.raises(ShardSetDamagedError, match="header says"):
        read_set(path)


def test_any_flipped_byte_in_the_buffer_is_refused_naming_the_file_and_chunk(
        written: tuple[Path, bytes, int]) -> None:
    path, raw, body = written
    shards = read_set(path)
    for chunk in shards.chunks:
        for offset in sorted({0, chunk.length // 2, chunk.length - 1}):
            if chunk.length == 0:
                continue
            damaged = bytearray(raw)
            damaged[body + chunk.start + offset] ^= 0x01
            path.write_bytes(bytes(damaged))
            refused(path, f"chunk {chunk.key[0]}@{list(chunk.key[1])} fails its sha256")
    path.write_bytes(raw)
    assert read_set(path).header() == shards.header()


def test_every_flipped_byte_of_every_tensor_chunk_is_refused(
        written: tuple[Path, bytes, int]) -> None:
    """Every byte of the tensors, every 61st of the (much longer) pickled extras."""
    path, raw, body = written
    for chunk in read_set(path).chunks:
        stride = 1 if chunk.dtype is not None else 61
        for i in range(body + chunk.start, body + chunk.start + chunk.length, stride):
            damaged = bytearray(raw)
            damaged[i] ^= 0x80
            path.write_bytes(bytes(damaged))
            with pytest.raises(ShardSetDamagedError, match="fails its sha256"):
                read_set(path)


def test_a_damaged_nbytes_key_is_refused_as_damage(written: tuple[Path, bytes, int]) -> None:
    path, raw, _ = written
    path.write_bytes(raw.replace(b'"nbytes"', b'"nbytez"', 1))
    refused(path)


def test_a_flipped_step_digit_in_the_header_is_refused(
        written: tuple[Path, bytes, int]) -> None:
    path, raw, _ = written
    path.write_bytes(raw.replace(b'"step": 42', b'"step": 43', 1))
    refused(path)


def test_a_chunk_whose_length_is_not_its_shapes_is_refused() -> None:
    shards = kept()
    data = shards.header()
    for chunk in data["chunks"]:
        if chunk[0] == "model.w":
            chunk[6] = [5, 3]  # 60 bytes claimed, 72 held
    with pytest.raises(ShardSetDamagedError, match=r"origin-x: chunk model\.w@\[0, 0\] has 72"):
        verify(header_of(data, shards.buffer), "origin-x")


# -- names


def test_set_names_parse_back_and_nothing_else_parses() -> None:
    assert set_file_name(42, 4, 3) == "shards-0000000042-w4-r3.bin"
    assert parse_set_name(set_file_name(42, 4, 3)) == (42, 4, 3)
    assert parse_set_name(set_file_name(0, 16, 15)) == (0, 16, 15)
    assert parse_set_name(set_file_name(9_999_999_999, 1, 0)) == (9_999_999_999, 1, 0)
    for name in ["shards-42-w4-r3.bin", "shards-0000000042-w4-r3.bin.tmp",
                 ".shards-0000000042-w4-r3.bin.host.123.tmp", "shards-0000000042-w4.bin",
                 "shards-0000000042-wx-r3.bin", "shards-0000000042-w4-r3.pt",
                 "xshards-0000000042-w4-r3.bin", "snapshot-0000000042.snap", ""]:
        assert parse_set_name(name) is None, name


def test_kept_sets_are_listed_newest_first_and_other_files_ignored(tmp_path: Path) -> None:
    for step, world, owner in [(3, 4, 1), (5, 2, 0), (5, 4, 2), (3, 4, 0), (5, 4, 0)]:
        (tmp_path / set_file_name(step, world, owner)).write_bytes(b"")
    (tmp_path / ".shards-0000000009-w4-r0.bin.h.1.tmp").write_bytes(b"")
    (tmp_path / "notes.txt").write_bytes(b"")
    found = [(s, w, o) for s, w, o, _ in list_sets(tmp_path)]
    assert found == [(5, 2, 0), (5, 4, 0), (5, 4, 2), (3, 4, 0), (3, 4, 1)]
    assert all(p == tmp_path / set_file_name(s, w, o) for s, w, o, p in list_sets(tmp_path))
    assert list_sets(tmp_path / "missing") == []


# -- DCP's view of the sets


def test_dcp_loads_the_captured_state_back_bit_exact() -> None:
    shards = kept()
    md = metadata([shards])
    assert set(md.state_dict_metadata) == set(TENSORS) | set(extras())
    assert md.planner_data == dict(shards.mappings)
    assert_state_is(load_back([shards]), tensors())


def test_two_ranks_sets_make_one_checkpoint_of_the_whole_tensors() -> None:
    """Rows 0-3 of a tensor on one "rank", rows 4-5 on another (as DCP names a row shard),
    with a replicated 0-d tensor on both: the metadata lists each chunk once."""
    full = torch.randn(6, 3)
    halves = []
    for owner, (first, rows) in enumerate([(0, 4), (4, 2)]):
        layout = plan_layout({"w": full[first:first + rows].clone(), "s": torch.tensor(1.5)})
        one = capture(layout, {}, step=2, round_=0, world_size=2, owner=owner)
        # as the save planner of a DTensor shard would name and size it
        data = one.header()
        for chunk in data["chunks"]:
            if chunk[0] == "w":
                chunk[1] = [first, 0]
        data["tensors"]["w"] = ["torch.float32", [6, 3]]
        halves.append(header_of(data, one.buffer))
    md = metadata(halves)
    w_md = md.state_dict_metadata["w"]
    assert [tuple(c.offsets) for c in w_md.chunks] == [(0, 0), (4, 0)]  # type: ignore[union-attr]
    assert len(md.state_dict_metadata["s"].chunks) == 1  # type: ignore[union-attr]
    chunks = {c.key: s.chunk_bytes(c) for s in halves for c in s.chunks}
    target = {"w": torch.zeros(6, 3), "s": torch.tensor(0.0)}
    quiet_load(target, MemoryReader(md, chunks))
    assert bits(target["w"]) == bits(full) and float(target["s"]) == 1.5


def test_metadata_of_chosen_chunks_lists_only_those() -> None:
    shards = kept()
    chosen = [c.key for c in shards.chunks if c.key[0] not in ("model.w", "rest")]
    md = metadata([shards], chosen)
    assert "rest" not in md.state_dict_metadata and "odd" in md.state_dict_metadata
    # the tensor is still described (its global shape), with no saved chunk of it
    w_md = md.state_dict_metadata["model.w"]
    assert tuple(w_md.size) == (6, 3) and w_md.chunks == []  # type: ignore[union-attr]
    n_md = md.state_dict_metadata["model.n"]
    assert [tuple(c.sizes) for c in n_md.chunks] == [(4,)]  # type: ignore[union-attr]
    assert math.prod(n_md.size) == 4  # type: ignore[union-attr]

"""torch's RendezvousBackend token contract, on a real etcd and on the embedded TCPStore.

Modelled on torch's own ``RendezvousBackendTestMixin``: current, stale, absent and
unknown tokens, and corrupt state.
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from torch.distributed import TCPStore
from torch.distributed.elastic.rendezvous import RendezvousStateError

from conftest import free_port
from elastic_ext.rendezvous.c10d_backend import C10dBackend
from elastic_ext.rendezvous.etcd_backend import EtcdBackend
from elastic_ext.rendezvous.liveness import LEFT
from support.stores import settings_for


@pytest.fixture(params=["etcd", "c10d"])
def make_backend(request) -> Iterator:
    """A factory: make_backend(run_id) -> backend on the parametrized store."""
    if request.param == "etcd":
        etcd = request.getfixturevalue("etcd")

        def make(run_id="run1", key_prefix="/elastic-ext"):
            return EtcdBackend(settings_for(etcd.members[0].endpoint, run_id, key_prefix=key_prefix))
        yield make
    else:
        port = free_port()
        server = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False,
                          multi_tenant=True, timeout=timedelta(seconds=5))

        def make(run_id="run1", key_prefix="/elastic-ext"):
            return C10dBackend(settings_for(f"c10d://127.0.0.1:{port}", run_id,
                                            key_prefix=key_prefix), server)
        yield make


@pytest.fixture
def backend(make_backend):
    return make_backend()


def set_state(backend, state, token=None):
    result = backend.set_state(state, token)
    assert result is not None
    return result


def test_get_state_returns_what_was_set_with_a_token(backend):
    backend.set_state(b"x")
    state, token = backend.get_state()
    assert state == b"x" and token is not None


def test_get_state_returns_none_when_there_is_no_state(backend):
    assert backend.get_state() is None


def test_set_state_creates_the_state_when_absent(backend):
    state, token, has_set = set_state(backend, b"x")
    assert (state, has_set) == (b"x", True) and token is not None


def test_set_state_with_the_current_token_succeeds_and_changes_the_token(backend):
    _, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y", token1)
    assert (state2, has_set) == (b"y", True) and token2 != token1


def test_set_state_with_a_stale_token_returns_the_current_state(backend):
    _, token1, _ = set_state(backend, b"x")
    state2, token2, _ = set_state(backend, b"y", token1)
    state3, token3, has_set = set_state(backend, b"z", token1)
    assert (state3, token3, has_set) == (state2, token2, False)


def test_set_state_without_a_token_does_not_overwrite_existing_state(backend):
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y")
    assert (state2, token2, has_set) == (state1, token1, False)


def test_set_state_with_an_unknown_token_returns_the_current_state(backend):
    state1, token1, _ = set_state(backend, b"x")
    state2, token2, has_set = set_state(backend, b"y", token="invalid")
    assert (state2, token2, has_set) == (state1, token1, False)


def test_garbage_in_the_state_key_is_a_state_error_not_a_crash(request, make_backend):
    backend = make_backend()
    if isinstance(backend, EtcdBackend):
        backend.client.put(backend.state_key, b"\x80\x04garbage")
    else:
        backend._store.set("state", b"\x80\x04garbage")
    with pytest.raises(RendezvousStateError, match="did not write"):
        backend.get_state()


def test_two_run_ids_do_not_see_each_other(make_backend):
    a, b = make_backend("job-a"), make_backend("job-b")
    set_state(a, b"a-state")
    assert b.get_state() is None
    set_state(b, b"b-state")
    assert a.get_state()[0] == b"a-state" and b.get_state()[0] == b"b-state"
    a.beat("n1")
    assert b.read_beats(["n1"]) == {"n1": None}


def test_heartbeats_advance_and_leaving_is_visible(backend):
    backend.beat("n1")
    first = backend.read_beats(["n1", "n2"])
    backend.beat("n1")
    second = backend.read_beats(["n1", "n2"])
    assert first["n2"] is None and first["n1"] != second["n1"]
    backend.leave("n1")
    assert backend.read_beats(["n1"])["n1"] == LEFT


def test_round_store_supports_what_torchs_agent_does_with_it(backend):
    store = backend.round_store("gen1", 3)
    store.set("torchelastic/role_info/0", b"r0")
    store.multi_set(["a", "b"], ["1", "2"])
    assert store.multi_get(["a", "b"]) == [b"1", b"2"]
    assert store.get("torchelastic/role_info/0") == b"r0"
    assert store.add("counter", 2) == 2 and store.add("counter", 3) == 5
    assert store.check(["a"]) and not store.check(["missing"])
    with pytest.raises((TimeoutError, RuntimeError)):  # etcd: TimeoutError; TCPStore: DistStoreError
        store.wait(["missing"], timedelta(milliseconds=200))
    other_round = backend.round_store("gen1", 4)
    assert not other_round.check(["a"])

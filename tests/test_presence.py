"""The presence port: only an active refusal says an agent is gone."""

from __future__ import annotations

import socket

import pytest

from elastic_ext.rendezvous.backend import heartbeat_value, parse_beat, presence_port_of
from elastic_ext.rendezvous.presence import PresenceListener, PresenceProbe, refuses


def test_a_listening_agent_is_present_and_a_closed_port_refuses() -> None:
    listener = PresenceListener()
    try:
        assert not refuses("127.0.0.1", listener.port)
        for _ in range(100):  # more than the backlog: drained, never full
            assert not refuses("127.0.0.1", listener.port)
            listener.drain()
    finally:
        listener.close()
    assert refuses("127.0.0.1", listener.port)


@pytest.mark.parametrize("error", [TimeoutError("timed out"), OSError(113, "No route to host"),
                                   OSError(22, "Invalid argument")])
def test_no_answer_is_not_a_refusal(monkeypatch: pytest.MonkeyPatch, error: OSError) -> None:
    def connect(*args: object, **kwargs: object) -> socket.socket:
        raise error
    monkeypatch.setattr(socket, "create_connection", connect)
    assert not refuses("10.0.0.1", 9)


def test_the_probe_remembers_a_refusal_and_does_not_hammer_a_live_port() -> None:
    probe = PresenceProbe()
    listener = PresenceListener()
    port = listener.port
    assert not probe.gone("127.0.0.1", port)
    listener.close()
    assert not probe.gone("127.0.0.1", port)  # probed moments ago: not again yet
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]
    assert probe.gone("127.0.0.1", closed) and probe.gone("127.0.0.1", closed)


def test_heartbeat_values_carry_the_port_and_old_values_still_parse() -> None:
    value = heartbeat_value(7, 4242)
    assert presence_port_of(value) == 4242 and parse_beat(value) is not None
    assert parse_beat(value)[0] == 7  # type: ignore[index]
    old = heartbeat_value(7)
    assert presence_port_of(old) is None and parse_beat(old) is not None
    for odd in (None, b"left", b"1:2:x", b"1:2:70000"):
        assert presence_port_of(odd) is None

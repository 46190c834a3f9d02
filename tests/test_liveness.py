"""Heartbeat judgement on the observer's own clock."""

from elastic_ext.rendezvous.protocol.liveness import LEFT, Liveness


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def watch(clock, beats_per_step, steps, step=0.5):
    live = Liveness(timeout=3.0, clock=clock)
    for i in range(steps):
        live.observe({node: f(i) for node, f in beats_per_step.items()})
        clock.now += step
    return live


def test_a_node_whose_counter_stops_is_dead_after_the_timeout_of_observation():
    clock = Clock()
    live = watch(clock, {"moving": lambda i: str(i).encode(), "stuck": lambda i: b"7"}, steps=7)
    assert not live.is_dead("moving")
    assert live.is_dead("stuck")


def test_a_node_is_not_dead_before_the_timeout():
    clock = Clock()
    live = watch(clock, {"stuck": lambda i: b"7"}, steps=5)  # 2.5 s observed
    assert not live.is_dead("stuck")


def test_unknown_nodes_are_alive_until_observed():
    assert not Liveness(3.0, Clock()).is_dead("never-seen")


def test_a_node_that_left_is_dead_at_once():
    live = Liveness(3.0, Clock())
    live.observe({"n": LEFT})
    assert live.is_dead("n")


def test_time_we_could_not_observe_counts_against_nobody():
    clock = Clock()
    live = Liveness(timeout=3.0, clock=clock)
    live.observe({"n": b"1"})
    live.blind()  # e.g. etcd down for 20 s
    clock.now += 20
    live.observe({"n": b"1"})
    assert not live.is_dead("n")
    for _ in range(6):
        clock.now += 0.5
        live.observe({"n": b"1"})
    assert live.is_dead("n")


def test_a_long_gap_between_our_own_reads_restarts_every_timer():
    clock = Clock()
    live = Liveness(timeout=3.0, clock=clock)
    live.observe({"n": b"1"})
    clock.now += 60  # this agent was frozen
    live.observe({"n": b"1"})
    assert not live.is_dead("n")


def test_a_heartbeat_key_that_vanishes_is_not_a_sign_of_life():
    clock = Clock()
    live = watch(clock, {"n": lambda i: b"1:0"}, steps=8)  # stuck for 4 s: dead
    assert live.is_dead("n")
    live.observe({"n": None})  # its etcd lease expired: the key is gone
    assert live.is_dead("n")
    clock.now += 0.5
    live.observe({"n": b"2:9"})  # a new value is: the node (or its lease) is back
    assert not live.is_dead("n")


def test_a_late_observer_judges_nobody_until_it_has_read_again():
    clock = Clock()
    live = watch(clock, {"a": lambda i: b"1"}, steps=4)  # a still for 2 s of observation
    clock.now += 2.0  # our keeper is late: no read for 2.5 s
    assert not live.is_dead("a")  # 4 s since it changed, but seen through a stale view
    live.observe({"a": b"1"})  # reading again after the gap restarts every timer
    assert not live.is_dead("a")
    for _ in range(6):
        clock.now += 0.5
        live.observe({"a": b"1"})
    assert live.is_dead("a")  # 3 s of fresh observation


# -- keys the store expires (etcd's leases, issue 27) ------------------------------------
def test_an_expiring_key_that_stays_is_alive_however_still_its_value() -> None:
    clock = Clock()
    live = Liveness(timeout=3.0, clock=clock, expiring=True)
    for _ in range(20):  # 10 s of one unchanged value: its lease is renewed, not its value
        live.observe({"n": b"1:0:4242"})
        clock.now += 0.5
    assert not live.is_dead("n") and live.silence()["n"] <= 0.5


def test_an_expiring_key_that_vanishes_is_dead_at_once_and_alive_when_it_comes_back() -> None:
    clock = Clock()
    live = Liveness(timeout=3.0, clock=clock, expiring=True)
    live.observe({"n": b"1:0"})
    clock.now += 0.5
    live.observe({"n": None})  # etcd deleted it: the lease ran out (a TTL without renewal)
    assert live.is_dead("n")
    clock.now += 0.5
    live.observe({"n": b"2:9"})  # the thawed agent granted a new lease and put its key
    assert not live.is_dead("n") and live.moved("n")


def test_an_expiring_key_never_seen_is_judged_like_a_still_counter() -> None:
    clock = Clock()
    live = Liveness(timeout=3.0, clock=clock, expiring=True)
    for _ in range(5):
        live.observe({"n": None})
        clock.now += 0.5
    assert not live.is_dead("n")  # 2.5 s: a joiner may not have put its key yet
    for _ in range(2):
        live.observe({"n": None})
        clock.now += 0.5
    assert live.is_dead("n")

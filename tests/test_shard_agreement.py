"""Which kept step a sharded job continues from (issue #40): ``plan_shard_restore`` over
reports of ``ShardSet.header()`` dicts, built here by hand. Pure: no processes, no torch.

The model of every case: one tensor ``m.w`` of shape [4, 2] cut by rows over the world that
trained the step (world 2: two rows a rank, world 4: one), one 0-d tensor ``m.s`` and one
non-tensor item ``__rest__`` that every rank holds whole. A chunk's sha256 is a stand-in
naming its content, so that two copies agree exactly when they were made equal here.
"""

from __future__ import annotations

from typing import Any

from elastic_ext.worker.snapshot.shard_agreement import ShardPlan, plan_shard_restore

ROWS, COLS = 4, 2
F32 = "torch.float32"


def rows_of(owner: int, world: int) -> tuple[int, int]:
    per = ROWS // world
    return owner * per, per


def header(step: int, world: int, owner: int, *, round_: int = 1, content: str = "",
           shape: tuple[int, ...] = (ROWS, COLS), rest: str = "rest") -> dict[str, Any]:
    """Rank ``owner``'s set of ``step`` at ``world``, as ``ShardSet.header()`` returns it.

    ``content`` tells apart two versions of the same chunk (different sha256); ``shape``
    is the global shape of ``m.w`` this set claims; ``rest`` the version of ``__rest__``."""
    first, n = rows_of(owner, world)
    items: list[tuple[str, list[int], int, str, str | None, list[int]]] = [
        ("__rest__", [], 7, f"sha-rest-{step}-{rest}", None, []),
        ("m.s", [], 4, f"sha-s-{step}", F32, []),
        ("m.w", [first, 0], n * COLS * 4, f"sha-w{first}-{step}{content}", F32, [n, COLS]),
    ]
    chunks, start = [], 0
    for fqn, offsets, length, sha, dtype, sizes in items:
        chunks.append([fqn, offsets, start, length, sha, dtype, sizes])
        start += length
    return {"format": 1, "step": step, "round": round_, "world_size": world, "owner": owner,
            "nbytes": start, "chunks": chunks,
            "tensors": {"m.s": [F32, []], "m.w": [F32, list(shape)]},
            "mappings": {"m.w": ["m", "w"], "m.s": ["m", "s"], "__rest__": ["__rest__"]}}


def whole(step: int, world: int, **kw: Any) -> list[dict[str, Any]]:
    return [header(step, world, owner, **kw) for owner in range(world)]


def key_w(first_row: int) -> tuple[str, tuple[int, ...]]:
    return ("m.w", (first_row, 0))


def used(plan: ShardPlan) -> list[tuple[int, int, int]]:
    """(step, world, owner) of every header the plan uses, in its order."""
    return [(h["step"], h["world_size"], h["owner"]) for h in plan.headers]


def holders_of(plan: ShardPlan, key: tuple[str, tuple[int, ...]]) -> dict[int, int]:
    """{holder: index into its report} of the copies of ``key`` the plan may read."""
    return {holder: held[key] for holder, held in plan.holdings.items() if key in held}


def one_warning(plan: ShardPlan, *parts: str) -> str:
    """The single warning that contains every one of ``parts``."""
    found = [w for w in plan.warnings if all(p in w for p in parts)]
    assert len(found) == 1, (parts, plan.warnings)
    return found[0]


# -- the newest whole step


def test_the_newest_whole_step_wins_and_each_holder_serves_its_own_sets() -> None:
    # Two new ranks: each holds step 3 and step 5 of two old ranks (world 4), the old
    # step listed first so that the indices into each report are not those of a group.
    reports = [[header(3, 4, 0), header(3, 4, 1), header(5, 4, 0), header(5, 4, 1)],
               [header(5, 4, 2), header(3, 4, 2), header(5, 4, 3), header(3, 4, 3)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (5, 4)
    assert plan.warnings == ()
    assert used(plan) == [(5, 4, 0), (5, 4, 1), (5, 4, 2), (5, 4, 3)]
    assert plan.holdings == {
        0: {key_w(0): 2, key_w(1): 3, ("m.s", ()): 2, ("__rest__", ()): 2},
        1: {key_w(2): 0, key_w(3): 2, ("m.s", ()): 0, ("__rest__", ()): 0},
    }


def test_a_step_lacking_a_ranks_chunks_falls_back_to_an_older_whole_step_naming_the_rank(
        ) -> None:
    # Step 7 of rank 2 was on the lost node and nowhere copied; step 5 is whole.
    reports = [[header(7, 4, 0), header(7, 4, 1), header(5, 4, 0), header(5, 4, 1)],
               [header(7, 4, 3), header(5, 4, 2), header(5, 4, 3)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (5, 4)
    assert used(plan) == [(5, 4, 0), (5, 4, 1), (5, 4, 2), (5, 4, 3)]
    warning = one_warning(plan, "step 7 (world 4) is not whole")
    assert "m.w lack chunks" in warning and "sets of ranks [2] are nowhere kept" in warning
    assert len(plan.warnings) == 1  # step 5 is not warned about


def test_every_missing_rank_is_named() -> None:
    plan = plan_shard_restore([[header(9, 4, 0)], [header(9, 4, 2)]])
    assert plan.step is None
    assert "sets of ranks [1, 3] are nowhere kept" in one_warning(plan, "step 9 (world 4)")


def test_nothing_whole_gives_no_step_and_a_warning_for_each_candidate() -> None:
    reports = [[header(7, 4, 0), header(5, 2, 0)], [header(7, 4, 1)]]
    plan = plan_shard_restore(reports)
    assert plan == ShardPlan(warnings=plan.warnings)
    assert (plan.step, plan.world_size, plan.holdings, plan.headers) == (None, 0, {}, ())
    one_warning(plan, "step 7 (world 4) is not whole", "ranks [2, 3]")
    one_warning(plan, "step 5 (world 2) is not whole", "ranks [1]")
    assert len(plan.warnings) == 2


def test_no_reports_no_step_no_warning() -> None:
    assert plan_shard_restore([]) == ShardPlan()
    assert plan_shard_restore([[], []]) == ShardPlan()


def test_a_tensor_chunk_alone_missing_makes_the_step_not_whole() -> None:
    # Rank 1's set is there, but its chunk of m.w is not (the set of one rank is cut short).
    partial = header(5, 2, 1)
    partial["chunks"] = [c for c in partial["chunks"] if c[0] != "m.w"]
    plan = plan_shard_restore([[header(5, 2, 0), partial], [header(3, 2, 0), header(3, 2, 1)]])
    assert plan.step == 3
    one_warning(plan, "step 5 (world 2) is not whole", "m.w lack chunks")


def test_a_lost_0d_tensor_makes_the_step_not_whole() -> None:
    sets = whole(5, 2)
    for s in sets:
        s["chunks"] = [c for c in s["chunks"] if c[0] != "m.s"]
    plan = plan_shard_restore([sets])
    assert plan.step is None
    one_warning(plan, "m.s lack chunks")


# -- two world sizes at one step


def test_two_worlds_at_the_same_step_the_larger_is_tried_first() -> None:
    # Restored at world 2 from world 4's step 5 and stopped before training: both whole.
    reports = [[*whole(5, 2), *whole(5, 4)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (5, 4)
    assert used(plan) == [(5, 4, o) for o in range(4)]
    assert holders_of(plan, key_w(3)) == {0: 5}  # index into the report: the 4th set of w4


def test_the_same_step_at_the_other_world_wins_over_an_older_step() -> None:
    # World 4's step 5 lacks rank 3; world 2's step 5 is whole; step 4 is whole as well.
    reports = [[*whole(5, 4)[:3], *whole(5, 2), *whole(4, 4)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (5, 2)
    assert used(plan) == [(5, 2, 0), (5, 2, 1)]
    one_warning(plan, "step 5 (world 4) is not whole", "ranks [3]")


# -- copies that disagree


def test_copies_that_differ_the_newest_rounds_win_and_the_stale_holders_are_named() -> None:
    # Rank 0 woke from a freeze with a copy of rank 1's chunk from round 1; rank 1's own
    # set and the copy on rank 2 are of round 2.
    reports = [[header(5, 2, 0, round_=2), header(5, 2, 1, round_=1, content="-old")],
               [header(5, 2, 1, round_=2)],
               [header(5, 2, 1, round_=2)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (5, 2)
    assert holders_of(plan, key_w(2)) == {1: 0, 2: 0}   # not rank 0's stale copy
    assert holders_of(plan, key_w(0)) == {0: 0}
    # The stale set's other chunks agree with the newest: they stay usable on rank 0.
    assert holders_of(plan, ("m.s", ())) == {0: 0, 1: 0, 2: 0}
    warning = one_warning(plan, "the copies of m.w@[2, 0] at step 5 differ")
    assert "rank 0: " in warning and "(round 1)" in warning and "(round 2)" in warning
    assert "ranks [0] hold an older round's, not used" in warning
    assert len(plan.warnings) == 1


def test_the_newest_round_wins_against_more_copies_of_an_older_one() -> None:
    # Two copies of rank 1's chunk: rank 0's of round 1, rank 1's of round 3. The round,
    # not the count of agreeing copies, decides.
    reports = [[header(5, 2, 0, round_=1), header(5, 2, 1, round_=1)],
               [header(5, 2, 1, round_=3, content="-new")]]
    plan = plan_shard_restore(reports)
    assert plan.step == 5
    assert holders_of(plan, key_w(2)) == {1: 0}
    one_warning(plan, "m.w@[2, 0]", "ranks [0] hold an older round's")


def test_copies_of_the_newest_round_that_differ_are_not_used_and_the_step_is_not_whole(
        ) -> None:
    reports = [[header(5, 2, 0, round_=2), header(5, 2, 1, round_=2, content="-a")],
               [header(5, 2, 1, round_=2, content="-b")],
               [*whole(3, 2)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (3, 2)
    assert used(plan) == [(3, 2, 0), (3, 2, 1)]
    one_warning(plan, "the copies of m.w@[2, 0] at step 5 differ", "none is used")
    one_warning(plan, "step 5 (world 2) is not whole", "m.w lack chunks")


def test_an_older_rounds_agreeing_majority_does_not_outvote_the_newest_round() -> None:
    # Round 2's copies disagree with each other; round 1's two agree: none is used.
    reports = [[header(5, 2, 0), header(5, 2, 1, round_=1)],
               [header(5, 2, 1, round_=1)],
               [header(5, 2, 1, round_=2, content="-x")],
               [header(5, 2, 1, round_=2, content="-y")]]
    plan = plan_shard_restore(reports)
    assert plan.step is None
    one_warning(plan, "m.w@[2, 0]", "none is used")


def test_agreeing_copies_are_all_usable_whatever_their_rounds() -> None:
    reports = [[header(5, 2, 0, round_=1), header(5, 2, 1, round_=1)],
               [header(5, 2, 1, round_=4)]]
    plan = plan_shard_restore(reports)
    assert plan.step == 5 and plan.warnings == ()
    assert holders_of(plan, key_w(2)) == {0: 1, 1: 0}


def test_a_non_tensor_item_whose_copies_disagree_makes_the_step_not_whole() -> None:
    reports = [[header(5, 2, 0, rest="a"), header(5, 2, 1, rest="b")], [*whole(3, 2)]]
    plan = plan_shard_restore(reports)
    one_warning(plan, "the copies of __rest__@[] at step 5 differ", "none is used")
    assert plan.step == 3


# -- shapes


def test_sets_that_disagree_on_a_tensors_shape_are_not_used() -> None:
    reports = [[header(5, 2, 0), header(5, 2, 1, shape=(ROWS + 1, COLS))], [*whole(3, 2)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (3, 2)
    one_warning(plan, "the kept sets of step 5 (world 2) disagree on the shape of m.w",
                "not using them")
    assert len(plan.warnings) == 1


def test_a_shape_of_another_step_or_world_is_not_a_disagreement() -> None:
    reports = [[*whole(5, 2), header(3, 2, 0, shape=(8, COLS)),
                header(5, 4, 0, shape=(8, COLS))]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (5, 2)
    assert not any("shape" in w for w in plan.warnings)


# -- holdings and the headers used


def test_every_holder_of_an_agreeing_copy_may_serve_it() -> None:
    # HSDP at world 4 with two replica groups: ranks 0 and 2 hold the same rows as 1, 3
    # (one new rank per old rank here). Each replica's set is its own owner's.
    def replica(owner: int) -> dict[str, Any]:
        h = header(6, 4, owner)
        shard = owner % 2
        h["chunks"] = [c if c[0] != "m.w" else
                       ["m.w", [shard * 2, 0], c[2], 2 * COLS * 4, f"sha-w{shard}", F32,
                        [2, COLS]]
                       for c in h["chunks"]]
        h["nbytes"] = sum(c[3] for c in h["chunks"])
        return h

    reports = [[replica(0)], [replica(1)], [replica(2)], [replica(3)]]
    plan = plan_shard_restore(reports)
    assert (plan.step, plan.world_size) == (6, 4)
    assert holders_of(plan, key_w(0)) == {0: 0, 2: 0}
    assert holders_of(plan, key_w(2)) == {1: 0, 3: 0}
    assert used(plan) == [(6, 4, o) for o in range(4)]


def test_a_holder_serves_a_chunk_from_its_first_set_that_has_it() -> None:
    # Rank 0 reports a copy of rank 1's set twice (its own and an identical held copy), and
    # a set of another step in between: the chunk is served from the first, and the second
    # (which adds nothing) is not among the headers used.
    reports = [[header(5, 2, 1), header(4, 2, 0), header(5, 2, 1), header(5, 2, 0)]]
    plan = plan_shard_restore(reports)
    assert plan.step == 5
    assert holders_of(plan, key_w(2)) == {0: 0}
    assert holders_of(plan, key_w(0)) == {0: 3}
    assert holders_of(plan, ("__rest__", ())) == {0: 0}
    assert used(plan) == [(5, 2, 1), (5, 2, 0)]  # in (holder, index) order: indices 0, 3


def test_the_headers_used_are_in_holder_then_index_order() -> None:
    reports = [[header(5, 4, 3), header(5, 4, 1)], [header(5, 4, 2), header(5, 4, 0)]]
    plan = plan_shard_restore(reports)
    assert used(plan) == [(5, 4, 3), (5, 4, 1), (5, 4, 2), (5, 4, 0)]


def test_a_plan_is_the_same_whatever_rank_computes_it() -> None:
    reports = [[header(7, 4, 0), header(7, 4, 1), *whole(5, 4)[:2]],
               [header(7, 4, 3), *whole(5, 4)[2:]]]
    first = plan_shard_restore(reports)
    again = plan_shard_restore([list(r) for r in reports])
    assert first == again


def test_a_plan_reads_headers_without_changing_them() -> None:
    reports = [[*whole(5, 2)], [header(5, 2, 1, round_=2, content="-z")]]
    before = repr(reports)
    plan_shard_restore(reports)
    assert repr(reports) == before


def test_holdings_name_only_chunks_of_the_chosen_step() -> None:
    reports = [[*whole(3, 2), *whole(5, 2)]]
    plan = plan_shard_restore(reports)
    assert plan.step == 5
    indices = {i for held in plan.holdings.values() for i in held.values()}
    assert indices == {2, 3}

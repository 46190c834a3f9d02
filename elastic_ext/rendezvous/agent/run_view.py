"""What a keeper knows of the run's state: its head always (``head.py``, a few bytes per
change), the whole state only while the keeper judges everyone (it names them), and what
follows for its round: whether it judges, and the dead of its round.

A keeper that neither closes nor watches the round judges only the watcher and goes by
the watcher's verdict, which names the dead of the last closed round
(``watcher.watcher_verdict``), so it never needs the round's member list: at 1,024
agents every keeper reading the whole state at each change was O(N²) bytes for the job
(issue 27).
"""

from __future__ import annotations

from elastic_ext.rendezvous.protocol.head import Head
from elastic_ext.rendezvous.protocol.liveness import Verdict
from elastic_ext.rendezvous.protocol.state import NodeInfo, Phase, RunState
from elastic_ext.rendezvous.protocol.watcher import watcher_verdict
from elastic_ext.rendezvous.stores.contract import StateDocument

_UNREAD = object()  # a version no store gives: nothing read yet


class RunView:
    """One keeper's reads of the state; used by its thread only."""

    def __init__(self, backend: StateDocument, node: str) -> None:
        self._backend = backend
        self._node = node
        self.version: object | None = _UNREAD  # the state's version read last
        self.head: Head | None = None
        self.token: object | None = None
        self._whole: tuple[object | None, RunState | None, object | None] = (_UNREAD, None, None)
        self.member_of: tuple[str, int] | None = None  # the last round this node ran in

    def refresh(self, version: object | None) -> bool:
        """Read the head as of ``version`` unless it was read already: whether it was."""
        if version == self.version:
            return False
        if self._backend.keeps_heads:
            current = self._backend.head_after(version)
            self.head, self.token = (Head.from_bytes(current[0]), current[1]) if current \
                else (None, None)
        else:  # derived from the whole state, which the view then keeps too
            state, self.token = self.read_state(version)
            self._whole = (version, state, self.token)
            self.head = Head.of(state) if state is not None else None
        self.version = version
        return True

    def state(self, read: bool) -> RunState | None:
        """The whole state as of the head, read now if ``read`` and not yet read; None when
        it was not read (or the run has none)."""
        if read and self._whole[0] != self.version:
            self._whole = (self.version, *self.read_state(self.version))
        return self._whole[1] if self._whole[0] == self.version else None

    @property
    def state_token(self) -> object | None:
        return self._whole[2]

    def read_state(self, version: object | None) -> tuple[RunState | None, object | None]:
        """The whole state as of ``version`` (None: the newest) and its token."""
        current = self._backend.state_after(version)
        return (RunState.from_bytes(current[0]), current[1]) if current else (None, None)

    def peers(self) -> tuple[set[str], dict[str, NodeInfo]]:
        """Whom the keeper reports heartbeat ages of, and where those it knows listen: the
        round's nodes and those waiting when the whole state was read; else the watcher
        and those waiting, and where the watcher listens."""
        state, head = self.state(read=False), self.head
        if state is not None:
            infos = {**state.members, **state.waiting}
            return set(infos), infos
        if head is None:
            return set(), {}
        infos = {head.closer: head.closer_info} \
            if head.closer is not None and head.closer_info is not None else {}
        return {*head.waiting, *infos}, infos

    def judges(self, dead: frozenset[str], replacing: bool = True) -> bool:
        """Whether this keeper judges everyone: it is the watcher, or the watcher is dead
        and this node is not in its round (a requeued job finding its old agents gone; a
        round's members need not: its end ends their round). In an open round only the
        joiner whose turn came (``replacing``: ``joins.replacement_turn``) does."""
        head = self.head
        watcher = head.closer if head else None
        return watcher is None or watcher == self._node or (
            watcher in dead and (head is None or (head.phase is Phase.OPEN and replacing)
                                 or (head.phase is not Phase.OPEN
                                     and (head.generation, head.round) != self.member_of)))

    def lost_of(self, round_: tuple[str, int], dead: frozenset[str],
                verdict: Verdict | None) -> frozenset[str]:
        """The dead among whom our workers train in ``round_``: from the whole state when
        it was read, else from the watcher's verdict of that round (and the watcher itself,
        rank 0 of a closed round, when judged dead)."""
        head, state = self.head, self.state(read=False)
        if state is not None:
            of_state = watcher_verdict(self._node, state, dead, frozenset())
            return of_state.lost - {self._node} \
                if (of_state.generation, of_state.round) == round_ else frozenset()
        watcher = head.closer if head else None
        lost: set[str] = set()
        if verdict is not None and verdict.by == watcher and \
                (verdict.generation, verdict.round) == round_:
            lost |= verdict.lost & dead
        if head is not None and watcher is not None and watcher in dead \
                and head.phase is Phase.CLOSED and (head.generation, head.round) == round_:
            lost.add(watcher)
        return frozenset(lost - {self._node})

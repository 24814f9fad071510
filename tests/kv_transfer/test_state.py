"""The per-transfer state machine both sides drive: every move, allowed or not, from every state."""

from __future__ import annotations

import itertools

import pytest

from pdserve.kv_transfer.state import IllegalTransition, Transfer, TransferState

S = TransferState
# How to reach each state legally from a new transfer.
PATHS = {S.BOOTSTRAPPING: [], S.TRANSFERRING: [S.TRANSFERRING], S.COMMITTING: [S.TRANSFERRING, S.COMMITTING],
         S.DONE: [S.TRANSFERRING, S.COMMITTING, S.DONE], S.FAILED: [S.FAILED]}
ALLOWED = {(S.BOOTSTRAPPING, S.TRANSFERRING), (S.BOOTSTRAPPING, S.FAILED), (S.TRANSFERRING, S.COMMITTING),
           (S.TRANSFERRING, S.FAILED), (S.COMMITTING, S.TRANSFERRING), (S.COMMITTING, S.DONE),
           (S.COMMITTING, S.FAILED)}


def reach(state: TransferState) -> Transfer:
    transfer = Transfer("t", "r")
    for step in PATHS[state]:
        transfer.advance(step)
    assert transfer.state is state
    return transfer


@pytest.mark.parametrize("start, target", itertools.product(S, S), ids=lambda s: s.value)
def test_every_move_is_allowed_or_refused_as_the_diagram_says(start, target):
    transfer = reach(start)
    if start is target:
        assert transfer.advance(target) is False and transfer.state is start  # no change
    elif (start, target) in ALLOWED:
        assert transfer.advance(target) is True and transfer.state is target
        assert target.value in transfer.events
    else:
        with pytest.raises(IllegalTransition):
            transfer.advance(target)
        assert transfer.state is start


@pytest.mark.parametrize("start", list(S), ids=lambda s: s.value)
def test_a_failure_ends_any_unfinished_transfer_once_and_leaves_a_finished_one(start):
    transfer = reach(start)
    failed = transfer.fail("boom")
    assert failed == (not start.is_terminal)
    assert transfer.state is (S.FAILED if failed else start)
    assert transfer.fail("again") is False and (transfer.error == "boom") == failed


@pytest.mark.parametrize("start", list(S), ids=lambda s: s.value)
def test_advance_unless_finished_never_moves_an_ended_transfer(start):
    """An ended transfer stays as it is (False); an unfinished one moves as `advance` would."""
    transfer = reach(start)
    if start is S.BOOTSTRAPPING:
        with pytest.raises(IllegalTransition):
            transfer.advance_unless_finished(S.COMMITTING)
        return
    assert transfer.advance_unless_finished(S.COMMITTING) == (start is S.TRANSFERRING)
    assert transfer.state is (S.COMMITTING if start in (S.TRANSFERRING, S.COMMITTING) else start)

"""Which transport a worker pair gets (`TransferSettings.pick`)."""

from __future__ import annotations

import pytest

from pdserve.kv_transfer.settings import TransferSettings

LISTENING = {"shm": "ipc:///tmp/kv", "tcp": "10.0.0.2:5000"}


def test_auto_picks_shared_memory_within_a_node_and_tcp_across() -> None:
    auto = TransferSettings()
    assert auto.receivers == ["shm", "tcp"]
    assert auto.pick(LISTENING, same_node=True) == "shm"
    assert auto.pick(LISTENING, same_node=False) == "tcp"
    assert auto.pick({"tcp": LISTENING["tcp"]}, same_node=True) == "tcp"


def test_shared_memory_asked_for_across_nodes_is_refused_saying_why() -> None:
    shm = TransferSettings(transport="shm")
    assert shm.pick(LISTENING, same_node=True) == "shm"
    with pytest.raises(ValueError, match="one node, and this pair is on two"):
        shm.pick(LISTENING, same_node=False)


def test_a_transport_the_decode_worker_does_not_listen_on_is_refused() -> None:
    with pytest.raises(ValueError, match="does not listen on 'gloo'"):
        TransferSettings(transport="gloo").pick(LISTENING, same_node=False)

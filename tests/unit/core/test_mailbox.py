"""The mailbox's routing of signals by topic (pure, over the fake signal endpoints):
messages that arrive before their topic opens wait for it, a closed topic's later
messages are dropped, and a topic forgotten before it opened (a session aborted before
its begin ran here) keeps nothing of what its source sent ahead."""

from __future__ import annotations

from ray_rdt_pool.core.mailbox import Mailbox
from ray_rdt_pool.testing import World


def _pair() -> tuple[Mailbox, Mailbox, str]:
    world = World()
    a, b = Mailbox(world.signals("a")), Mailbox(world.signals("b"))
    return a, b, a.connect(b.metadata())


def test_a_message_sent_ahead_waits_for_its_topic() -> None:
    a, b, to_b = _pair()
    a.send(to_b, "s1", 2, 7)
    b.pump()
    assert b.pending() == 1
    msg = b.open("s1").get_nowait()
    assert msg is not None and (msg.kind, msg.item) == (2, 7) and b.pending() == 0


def test_a_forgotten_topic_keeps_nothing_now_or_later_but_spares_an_open_one() -> None:
    a, b, to_b = _pair()
    a.send(to_b, "gone", 2, 1)
    b.pump()
    b.forget("gone")
    a.send(to_b, "gone", 2, 2)
    b.pump()
    assert b.pending() == 0
    box = b.open("live")
    a.send(to_b, "live", 2, 3)
    b.forget("live")  # a live session is not forgotten under its reader
    b.pump()
    msg = box.get_nowait()
    assert msg is not None and msg.item == 3 and b.sessions() == 1

"""PostedBatch.wait: a deadline in both wait modes, and errors that say what happened."""

import datetime
import time

import pytest
import torch

from megapipe.pipeline.p2p import (
    CommOp,
    P2PPeerError,
    P2PTimeoutError,
    PostedBatch,
    backend_message,
)
from megapipe.schedule.ir import parse_action

GLOO_DEAD_PEER = (
    "[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed "
    "by peer [127.0.0.1]:41234. This is typically caused by a remote worker crashing."
)


class _Work:
    """A fake ``dist.Work``: completes after ``polls`` queries, then ``wait`` raises ``error``."""

    def __init__(self, polls=0, error=None, blocks_s=0.0):
        self.polls, self.error, self.blocks_s = polls, error, blocks_s
        self.waited_with = []

    def is_completed(self):
        self.polls -= 1
        return self.polls < 0

    def wait(self, timeout=None):
        self.waited_with.append(timeout)
        time.sleep(self.blocks_s)
        if self.error is not None:
            raise self.error
        return True


def _batch(work, mode, timeout_s=0.3):
    op = CommOp(parse_action("1RECV_F0"), peer=0, tensor=torch.empty(1))
    return PostedBatch([op], [work], rank=1, timeout=datetime.timedelta(seconds=timeout_s),
                       wait_mode=mode)


def test_poll_mode_raises_at_the_deadline_naming_action_and_peer():
    started = time.monotonic()
    with pytest.raises(P2PTimeoutError) as err:
        _batch(_Work(polls=10**9), "poll").wait()
    assert 0.3 <= time.monotonic() - started < 2.0
    assert "rank 1:" in str(err.value) and "1RECV_F0 (receive from rank 0)" in str(err.value)
    assert "within 0.3s" in str(err.value)


def test_poll_mode_then_orders_the_stream_with_a_plain_wait():
    work = _Work(polls=5)
    batch = _batch(work, "poll")
    batch.wait()
    assert work.waited_with == [None] and batch.done


def test_a_dead_peer_is_not_called_a_timeout():
    for mode in ("block", "poll"):
        with pytest.raises(P2PPeerError) as err:
            _batch(_Work(error=RuntimeError(GLOO_DEAD_PEER)), mode).wait()
        message = str(err.value)
        assert "did not complete within" not in message, mode
        assert "connection to rank 0 broke" in message and "1RECV_F0" in message, mode
        assert "Connection closed by peer [127.0.0.1]:41234)" in message, mode  # gloo's text, short


def test_block_mode_hands_the_remaining_time_to_the_backend():
    work = _Work(error=RuntimeError("[unbound_buffer.cc:78] Timed out waiting 300ms for recv"),
                 blocks_s=0.3)
    with pytest.raises(P2PTimeoutError):
        _batch(work, "block").wait()
    assert 0.2 < work.waited_with[0].total_seconds() <= 0.3


def test_backend_message_is_one_short_line():
    assert backend_message(RuntimeError(GLOO_DEAD_PEER)) == (
        "Connection closed by peer [127.0.0.1]:41234")
    assert backend_message(ValueError("a\nb")) == "a"
    assert backend_message(KeyError()) == "KeyError"

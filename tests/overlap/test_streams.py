"""CPU streams: in-order work, events carrying values, waits, failures, grad mode."""

import threading
import time

import pytest
import torch

from megapipe.overlap.device_streams import make_streams
from megapipe.overlap.streams import InlineStream, StreamFailed, WorkerStream


def test_worker_stream_runs_in_order_on_its_own_thread():
    with make_streams("cpu") as streams:
        seen = []
        events = [
            streams.comm.submit(lambda i=i: seen.append((i, threading.current_thread().name)) or i)
            for i in range(5)
        ]
        assert [e.value_on(streams.compute) for e in events] == list(range(5))
        assert [i for i, _ in seen] == list(range(5))
        assert {name for _, name in seen} == {"megapipe-comm"}


def test_inline_stream_runs_at_once_and_comm_runs_concurrently():
    with make_streams("cpu") as streams:
        assert isinstance(streams.compute, InlineStream) and isinstance(streams.comm, WorkerStream)
        spans = {}

        def nap(name):
            start = time.perf_counter()
            time.sleep(0.2)
            spans[name] = (start, time.perf_counter())

        event = streams.comm.submit(nap, "comm")
        streams.compute.submit(nap, "compute")
        streams.compute.wait_event(event)
        assert event.query()
        # the two ran at the same time: each began before the other ended (an order of
        # events, not a duration)
        assert spans["comm"][0] < spans["compute"][1] and spans["compute"][0] < spans["comm"][1]


def test_wait_event_orders_work_across_streams():
    with make_streams("cpu") as streams:
        other = WorkerStream("other")
        try:
            seen = []
            first = other.submit(lambda: (time.sleep(0.05), seen.append("first")))
            streams.comm.wait_event(first)
            streams.comm.submit(seen.append, "second")
            streams.comm.synchronize()
            assert seen == ["first", "second"]
        finally:
            other.close()


def test_failure_reaches_the_host_and_poisons_later_work():
    stream = WorkerStream("comm")
    try:
        bad = stream.submit(lambda: 1 / 0)
        later = stream.submit(lambda: 3)
        with pytest.raises(ZeroDivisionError):
            bad.synchronize()
        with pytest.raises(StreamFailed, match="earlier failure"):
            later.synchronize()
    finally:
        stream.close()
    with pytest.raises(RuntimeError, match="closed"):
        stream.submit(lambda: None)


def test_worker_uses_the_submitters_grad_mode():
    with make_streams("cpu") as streams:
        with torch.no_grad():
            off = streams.comm.submit(torch.is_grad_enabled)
        on = streams.comm.submit(torch.is_grad_enabled)
        assert off.value_on(streams.compute) is False and on.value_on(streams.compute) is True


def test_make_streams_rejects_unknown_devices():
    with pytest.raises(ValueError, match="'meta' is not supported"):
        make_streams("meta")


def test_a_worker_event_releases_every_waiter_and_keeps_its_value():
    with make_streams("cpu") as streams:
        gate = threading.Event()
        event = streams.comm.submit(lambda: (gate.wait(5), 7)[1])
        assert not event.query()
        results = []
        waiters = [threading.Thread(target=lambda: results.append(event.value_on(streams.compute)))
                   for _ in range(3)]
        for waiter in waiters:
            waiter.start()
        gate.set()
        for waiter in waiters:
            waiter.join(5)
        assert results == [7, 7, 7] and event.query()
        assert event.value_on(streams.compute) == 7  # and again, after completion

"""Streams and events: one interface, a CUDA and a CPU implementation with the same semantics.

A ``Stream`` runs submitted work in order; ``submit(fn)`` returns an ``Event`` that completes
with ``fn``'s work and carries its value; ``wait_event(e)`` makes later work wait for ``e``;
``e.value_on(stream)`` hands the value to work on ``stream`` (a tensor crossing streams).

- CUDA (``CudaStream``, ``cuda_streams``): ``fn`` runs on the host at once with that stream
  current (the compute stream is the device's current stream: no switch), so its kernels queue
  on it; the combined step's events are made once and reused (``run``, ``recycle``); a tensor
  handed to another stream gets ``record_stream``; the comm stream may have high priority.
- CPU: the compute stream (``InlineStream``) is the calling thread: ``fn`` runs at once. The
  comm stream (``WorkerStream``) is one worker thread; its events are locks the worker
  releases. gloo collectives and torch ops release the GIL, so the two really run together.

Rule: a process group is driven from exactly one stream (``Streams.claim`` refuses a second);
every rank issues its comm nodes in the same order on that one stream, so collectives match.
``make_streams`` (``device_streams``) gives a device's pair, CUDA's or the CPU's.
"""

from __future__ import annotations

import queue
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch


class Event(ABC):
    """Completion of some submitted work, with the value its function returned."""

    @abstractmethod
    def synchronize(self) -> None:
        """Block the calling thread until the work is complete (re-raising its error)."""

    @abstractmethod
    def query(self) -> bool:
        """Whether the work is complete (never blocks)."""

    @abstractmethod
    def value_on(self, stream: Stream) -> Any:
        """The value, made safe for work submitted to ``stream`` from now on."""


def _dropped(fn: Callable[..., Any], args: tuple) -> None:
    """``fn(*args)``, its value dropped (``Stream.run``)."""
    fn(*args)


class Stream(ABC):
    """An ordered queue of work (see the module docstring)."""

    name: str
    runs_on_host: bool = False  # ``submit`` returns once the work is done (the CPU host thread)
    keeps_memory: bool = False  # ``record_use`` keeps memory (a CUDA caching allocator)

    @abstractmethod
    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Event:
        """Run ``fn(*args, **kwargs)`` on this stream after its earlier work."""

    @abstractmethod
    def wait_event(self, event: Event) -> None:
        """Work submitted after this call starts only after ``event`` completed."""

    @abstractmethod
    def record_event(self) -> Event:
        """An event that completes when all work submitted so far has completed."""

    def synchronize(self) -> None:
        """Block the calling thread until all work submitted so far has completed."""
        self.record_event().synchronize()

    def run(
        self, fn: Callable[..., Any] | None, args: tuple = (), record: bool = True
    ) -> Event | None:
        """The combined step's ``submit``: ``fn(*args)`` (None: only the event), an event only
        when ``record`` (a CPU stream always gives one). The event carries no value (the step
        keeps its events to its end; a value kept would keep, say, a gradient alive after its
        reader ran). Events given this way may be recorded again after ``recycle``."""
        return self.submit(_dropped, fn, args) if fn is not None else self.record_event()

    def recycle(self) -> None:
        """Every wait on the events ``run`` gave so far has been issued: they may be reused."""

    def mark(self) -> Any:
        """A timing point in this stream's work for ``NodeTrace``: None means "read the host
        clock now" (streams whose work runs on a host thread); a CUDA stream records an event."""
        return None

    def record_use(self, values: Any) -> None:
        """The tensors in ``values`` (made on another stream) are used by work on this stream:
        keep their memory until that work is done (CUDA ``record_stream``; nothing on CPU)."""

    def close(self) -> None:
        """Release resources (threads); the stream must not be used afterwards."""

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"


# ---- CPU ----------------------------------------------------------------------------------


class DoneEvent(Event):
    """A CPU event complete from the start: the work already ran on the calling thread."""

    __slots__ = ("value",)

    def __init__(self, value: Any = None) -> None:
        self.value = value

    def synchronize(self) -> None:
        pass

    def query(self) -> bool:
        return True

    def value_on(self, stream: Stream) -> Any:
        return self.value


class WorkerEvent(Event):
    """A CPU event that the worker thread completes once the work ran: a plain lock, held until
    then, and the work's value or error (a ``Future`` would cost a ``Condition`` per node)."""

    __slots__ = ("_lock", "_done", "_value", "_error")

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._lock.acquire()
        self._done = False
        self._value: Any = None
        self._error: BaseException | None = None

    def complete(self, value: Any = None, error: BaseException | None = None) -> None:
        """Called once, by the thread that ran the work."""
        self._value, self._error = value, error
        self._done = True
        self._lock.release()

    def synchronize(self) -> None:
        if not self._done:
            with self._lock:  # free once complete; each waiter takes and gives it back in turn
                pass
        if self._error is not None:
            raise self._error

    def query(self) -> bool:
        return self._done

    def value_on(self, stream: Stream) -> Any:
        # whatever the consumer, the value is complete once the work is: block until then
        self.synchronize()
        return self._value


class InlineStream(Stream):
    """The CPU compute stream: work runs at once on the calling thread."""

    runs_on_host = True

    def __init__(self, name: str = "compute") -> None:
        self.name = name

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Event:
        return DoneEvent(fn(*args, **kwargs))

    def run(
        self, fn: Callable[..., Any] | None, args: tuple = (), record: bool = True
    ) -> Event | None:
        if fn is not None:
            fn(*args)
        return DoneEvent()

    def wait_event(self, event: Event) -> None:
        event.synchronize()

    def record_event(self) -> Event:
        return DoneEvent()


class StreamFailed(RuntimeError):
    """Work on a stream was skipped because earlier work on it had failed."""


class WorkerStream(Stream):
    """A CPU communication stream: one worker thread runs submitted work in order.

    After a failure every later item fails too (naming the first error), as a CUDA stream
    stays broken after a fault; the error reaches the host through the events.
    """

    def __init__(self, name: str = "comm") -> None:
        self.name = name
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._failed: BaseException | None = None
        self._thread = threading.Thread(target=self._loop, name=f"megapipe-{name}", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            event, fn, args, kwargs, grad_enabled = item
            if self._failed is not None:
                event.complete(
                    error=StreamFailed(
                        f"stream {self.name!r} skipped work after "
                        f"an earlier failure: {self._failed!r}"
                    )
                )
                continue
            try:
                if grad_enabled == torch.is_grad_enabled():
                    value = fn(*args, **kwargs)
                else:
                    with torch.set_grad_enabled(grad_enabled):
                        value = fn(*args, **kwargs)
            except BaseException as error:  # handed to the host through the event
                self._failed = error
                event.complete(error=error)
            else:
                event.complete(value)

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Event:
        if not self._thread.is_alive():
            raise RuntimeError(f"stream {self.name!r} is closed")
        event = WorkerEvent()
        self._queue.put((event, fn, args, kwargs, torch.is_grad_enabled()))
        return event

    def wait_event(self, event: Event) -> None:
        if not event.query():
            self.submit(event.synchronize)

    def record_event(self) -> Event:
        return self.submit(lambda: None)

    def close(self) -> None:
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join()


# ---- the pair -----------------------------------------------------------------------------


@dataclass
class Streams:
    """The compute and communication streams of one process, and which stream owns which group."""

    compute: Stream
    comm: Stream
    _owners: dict[int, tuple[Any, str]] = field(default_factory=dict, repr=False)

    def claim(self, group: Any, stream: Stream) -> None:
        """Record that ``stream`` drives ``group``; refuse if another stream already does."""
        if group is None:
            return
        owner = self._owners.get(id(group))
        if owner is None:  # the group itself is kept so that its id stays unique
            self._owners[id(group)] = (group, stream.name)
        elif owner[1] != stream.name:
            raise RuntimeError(
                f"process group {group!r} is driven from stream {owner[1]!r}; it cannot also be "
                f"driven from {stream.name!r} (collectives would be issued in different orders)"
            )

    def synchronize(self) -> None:
        self.comm.synchronize()
        self.compute.synchronize()

    def recycle(self) -> None:
        """A combined step ended: every wait on the events ``Stream.run`` gave is issued."""
        self.comm.recycle()
        self.compute.recycle()

    def close(self) -> None:
        self.comm.close()
        self.compute.close()

    def __enter__(self) -> Streams:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

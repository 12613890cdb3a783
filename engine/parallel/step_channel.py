"""The step channel of a tensor-parallel node: rank 0 sends every worker rank each step's
``ForwardInputs`` (step_inputs.py), in order, over zmq (msgspec msgpack), plus
``Control`` messages ordered with the steps and a final ``Stop``; a worker sends rank 0
``RankHello`` when it connects and ``Failed`` when it cannot start.

Owns the messages and both ends (``StepSender`` on rank 0, ``StepReceiver`` on a worker).
Must not: run the model, or carry tensors (collectives do, group.py). Not
torch.distributed's object broadcast (a pickle and two collectives per step) and not
HTTP: one msgpack encode and one zmq send per worker per step.

::

    rank 0: ROUTER (bound; ROUTER_MANDATORY)            worker r: DEALER (identity b"rank<r>")
      <-- RankHello(r, pid) -------------------------------- on connect
      --- ForwardInputs | Control(kind, payload) | Stop -->  recv(), in send order
      <-- Failed(r, error) --------------------------------- its start-up raised

Failure is seen on both ends without waiting for a collective:
- a worker that is gone makes rank 0's next send raise ``StepChannelClosed`` at once
  (ROUTER_MANDATORY: a message for an unknown peer is an error, not a silent drop);
- rank 0 gone (its socket closed, or silent past zmq's heartbeat timeout) makes a
  worker's ``recv`` raise ``StepChannelClosed`` (the DEALER's monitor reports the disconnect).

Nothing is dropped or blocks: both ends queue without a high-water mark (a step's inputs
are kilobytes; rank 0 sends one per step and waits for the step itself).
One thread uses each end (zmq sockets are not thread-safe): rank 0's engine thread.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable

import msgspec
import zmq
from zmq.utils.monitor import recv_monitor_message

from .group import TPFailure
from ..step_inputs import ForwardInputs

HEARTBEAT_IVL_MS = 1000  # zmq pings between the ends ...
HEARTBEAT_TIMEOUT_MS = 10000  # ... and drops a connection silent for this long (a lost host)


class RankHello(msgspec.Struct, tag="hello", array_like=True):
    rank: int
    pid: int


class Failed(msgspec.Struct, tag="failed", array_like=True):
    rank: int
    error: str  # the exception, as the worker saw it


class Control(msgspec.Struct, tag="control", array_like=True):
    """An instruction for the node's code on every worker (run_worker's ``controls[kind]``),
    handled between the step sent before it and the one sent after it."""
    kind: str
    payload: bytes


class Stop(msgspec.Struct, tag="stop", array_like=True):
    pass


ToWorker = ForwardInputs | Control | Stop
ToLeader = RankHello | Failed


class StepChannelClosed(TPFailure):
    """The other end of the step channel is gone."""


def _options(sock: zmq.Socket) -> None:
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.setsockopt(zmq.RCVHWM, 0)
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)


def _identity(rank: int) -> bytes:
    return b"rank%d" % rank


class StepSender:
    """Rank 0's end: bind, wait for every worker's RankHello, then send to all of them."""

    def __init__(self, size: int, addr: str = "tcp://127.0.0.1:*"):
        """``addr``: where to bind (zmq syntax; ``*`` as the port picks a free one)."""
        self.size = size
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        _options(self._sock)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._sock.bind(addr)
        self.addr: str = self._sock.getsockopt_string(zmq.LAST_ENDPOINT)  # what workers connect to
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToLeader)
        self._peers = [_identity(r) for r in range(1, size)]
        self.pids: dict[int, int] = {}  # rank -> pid, from its RankHello
        self.failures: list[Failed] = []  # what workers reported

    def wait_workers(self, timeout_s: float, dead: Callable[[], str | None] = lambda: None) -> None:
        """Return once every worker said RankHello. Raises ``StepChannelClosed`` when one reports a
        failure, ``dead()`` names a problem (e.g. a started process exited), or
        ``timeout_s`` passes (naming the ranks still missing)."""
        deadline = time.monotonic() + timeout_s
        while len(self.pids) < self.size - 1:
            if self._sock.poll(100):
                self._take()
                continue
            problem = dead()
            if problem is not None:
                raise StepChannelClosed(f"tensor-parallel workers did not start: {problem}")
            if time.monotonic() > deadline:
                missing = sorted(set(range(1, self.size)) - set(self.pids))
                raise StepChannelClosed(f"tensor-parallel ranks {missing} did not connect to {self.addr} "
                                    f"within {timeout_s:g} s")

    def _take(self) -> None:
        _, data = self._sock.recv_multipart()
        msg = self._decoder.decode(data)
        if isinstance(msg, Failed):
            self.failures.append(msg)
            raise StepChannelClosed(f"tensor-parallel rank {msg.rank} failed to start: {msg.error}")
        self.pids[msg.rank] = msg.pid

    def drain(self) -> list[Failed]:
        """Failures reported so far (non-blocking); for an error message."""
        try:
            while self._sock.poll(0):
                self._take()
        except (StepChannelClosed, zmq.ZMQError, msgspec.DecodeError):
            pass
        return self.failures

    def send(self, msg: ToWorker) -> None:
        """To every worker, in rank order. Raises ``StepChannelClosed`` when one is gone."""
        data = self._encoder.encode(msg)
        for peer in self._peers:
            try:
                self._sock.send_multipart((peer, data), copy=False)
            except zmq.ZMQError as e:
                raise StepChannelClosed(f"tensor-parallel {peer.decode()} left the step channel ({e})") from e

    def close(self) -> None:
        self._sock.close(linger=0)
        self._ctx.term()


class StepReceiver:
    """A worker's end: connect, say RankHello, then receive rank 0's messages in order."""

    def __init__(self, addr: str, rank: int):
        self.rank = rank
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        self._sock.setsockopt(zmq.IDENTITY, _identity(rank))
        _options(self._sock)
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED)
        self._sock.connect(addr)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self._connected = False
        self._encoder = msgspec.msgpack.Encoder()
        self._decoder = msgspec.msgpack.Decoder(ToWorker)
        self._sock.send(self._encoder.encode(RankHello(rank, os.getpid())))

    def recv(self) -> ToWorker:
        """The next message (blocks). Raises ``StepChannelClosed`` once rank 0 disconnected."""
        while True:
            ready = dict(self._poller.poll())
            if self._sock in ready:
                return self._decoder.decode(self._sock.recv())
            if self._monitor in ready:
                event = recv_monitor_message(self._monitor)["event"]
                if event == zmq.EVENT_CONNECTED:
                    self._connected = True
                elif event == zmq.EVENT_DISCONNECTED and self._connected:
                    raise StepChannelClosed(f"tensor-parallel rank {self.rank}: rank 0 closed the step channel")

    def report_failure(self, error: str) -> None:
        """Tell rank 0 why this worker cannot start (best effort: it may be gone)."""
        try:
            self._sock.send(self._encoder.encode(Failed(self.rank, error)), zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def close(self) -> None:
        self._sock.disable_monitor()
        self._monitor.close(linger=0)
        # linger: a Failed report queued just now still leaves before the process exits
        self._sock.close(linger=1000)
        self._ctx.term()

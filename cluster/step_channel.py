"""The step path between an engine and its rank actors: one TCP connection per rank, no Ray task per step.

Ray places, starts and supervises the ranks; steps do not go through it. At start-up the driver
listens on a free port of its node and every rank actor connects from a thread of its own (the rank
loop), which then receives a step, runs it and answers, for as long as the connection lives. A step
is one `send` of the same bytes to every rank and one small answer from each (the output rank's
carries the sampled tokens). On a 2-core CPU a round trip costs tens of microseconds where a Ray task
per rank cost about a millisecond (scripts/bench_step_dispatch.py).

Failure stays loud and fast: a rank that raises answers with the error; a rank whose process dies
closes its socket, which the driver sees at once (it waits on all ranks' sockets together); a rank
that stops answering hits the step deadline. Each names the rank.

Waiting can spin (`spin_s`): a thread blocked in `select`/`recv` for a whole GPU step sleeps, and its
core's wake-up costs tens of microseconds per hop on the step's critical path (the same reason CUDA
spin-waits on a synchronize). With GPU ranks the driver polls for the answers and each rank loop polls
for the next step for up to `spin_s` before blocking; CPU ranks never spin (they compute on the cores
a spinner would take).

A rank on the driver's node connects over a Unix socket (Linux's abstract namespace: no file to clean up), which
takes a third less per hop than TCP over loopback; a rank elsewhere, or where that connect fails, uses TCP.

Frames are an 8-byte little-endian length, then a pickle (driver -> rank: a message tuple; rank ->
driver: ("ok", result) or ("error", text)).
"""
from __future__ import annotations

import os
import pickle
import secrets
import select
import socket
import struct
import sys
import threading
import time
import traceback
from typing import Any, Callable

_HEADER = struct.Struct("<Q")
_SMALL = 1 << 16  # frames up to this size are read with one plain recv when they are all there

# Every rank loop's handler stays referenced from here, so a loop thread that ends while the process
# exits (its driver hung up during shutdown) never drops the last reference to the rank's model: a
# daemon thread freeing CUDA/torch objects during interpreter finalization is killed mid-free and the
# process aborts.
_HANDLERS: list[Callable[[tuple], Any]] = []


class ChannelClosed(ConnectionError):
    """The peer closed the connection (its process exited or was killed)."""


def _configure(sock: socket.socket) -> None:
    if sock.family != socket.AF_UNIX:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # small frames go out at once


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    if n <= _SMALL:
        first = sock.recv(n)  # a small frame usually comes whole: no buffer to fill and copy
        if len(first) == n:
            return first
        if not first:
            raise ChannelClosed("connection closed")
    else:
        first = b""
    buf = bytearray(n)
    buf[:len(first)] = first
    view, got = memoryview(buf), len(first)
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if k == 0:
            raise ChannelClosed("connection closed")
        got += k
    return bytes(buf)


def recv_frame(sock: socket.socket) -> bytes:
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return _recv_exact(sock, n)


def send_frame(sock: socket.socket, payload: bytes) -> None:
    sock.sendall(_HEADER.pack(len(payload)) + payload)


class StepChannel:
    """Driver side. `ranks` answer in any order; `describe(rank)` names a rank in errors."""

    def __init__(self, host: str, world_size: int, spin_s: float = 0.0):
        self.world_size = world_size
        self.spin_s = spin_s
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.bind((host, 0))
        self._listener.listen(world_size)
        self.address = (host, self._listener.getsockname()[1])
        # The same-node ranks' way in (`run_rank_loop`'s local_path); None where Unix sockets are not to be had.
        self.local_path: str | None = None
        self._local_listener: socket.socket | None = None
        if hasattr(socket, "AF_UNIX") and sys.platform.startswith("linux"):
            self.local_path = f"\0tandem-steps-{os.getpid()}-{secrets.token_hex(8)}"
            self._local_listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            self._local_listener.bind(self.local_path)
            self._local_listener.listen(world_size)
        self._socks: dict[int, socket.socket] = {}

    def accept(self, timeout_s: float) -> None:
        """Wait for every rank to connect, over TCP or the local socket (each sends its rank id first)."""
        deadline = time.monotonic() + timeout_s
        listeners = [lst for lst in (self._listener, self._local_listener) if lst is not None]
        while len(self._socks) < self.world_size:
            ready, _, _ = select.select(listeners, [], [], max(deadline - time.monotonic(), 0.0))
            if not ready:
                missing = sorted(set(range(self.world_size)) - set(self._socks))
                raise TimeoutError(f"ranks {missing} did not connect their step loop within {timeout_s:.0f}s")
            sock, _ = ready[0].accept()
            sock.settimeout(None)
            _configure(sock)
            (rank,) = struct.unpack("<I", _recv_exact(sock, 4))
            self._socks[rank] = sock
        self._close_listeners()

    def _close_listeners(self) -> None:
        for listener in (self._listener, self._local_listener):
            if listener is not None:
                try:
                    listener.close()
                except OSError:
                    pass

    def broadcast(self, message: tuple) -> None:
        frame = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        framed = _HEADER.pack(len(frame)) + frame
        for rank, sock in self._socks.items():
            try:
                sock.sendall(framed)
            except OSError as e:
                raise RankFailure(rank, f"died (its step connection broke: {e})") from e

    def gather(self, timeout_s: float) -> dict[int, Any]:
        """Every rank's answer, waiting on all sockets at once so the first failure ends the wait."""
        pending = {sock: rank for rank, sock in self._socks.items()}
        results: dict[int, Any] = {}
        deadline = time.monotonic() + timeout_s
        spin_until = min(time.monotonic() + self.spin_s, deadline)
        while pending:
            spinning = time.monotonic() < spin_until
            wait = 0.0 if spinning else max(deadline - time.monotonic(), 0.0)
            ready, _, _ = select.select(list(pending), [], [], wait)
            if not ready and spinning:
                continue
            if not ready:
                raise RankFailure(min(pending.values()), f"did not answer within {timeout_s:.0f}s",
                                  late=sorted(pending.values()))
            for sock in ready:
                rank = pending.pop(sock)
                try:
                    status, value = pickle.loads(recv_frame(sock))
                except (ChannelClosed, OSError) as e:
                    raise RankFailure(rank, f"died (its step connection closed: {e})") from e
                if status == "error":
                    dead = _first_dead([r for r in pending.items()], ERROR_GRACE_S)
                    if dead is not None:  # a rank's error came from a peer that died: name the dead one
                        raise RankFailure(dead[0], f"died (its step connection closed: {dead[1]})")
                    raise RankFailure(rank, f"raised {value}")
                results[rank] = value
        return results

    def close(self) -> None:
        for sock in self._socks.values():
            try:
                sock.close()
            except OSError:
                pass
        self._socks.clear()
        self._close_listeners()


# When a rank answers with an error, how long the driver watches the ranks still to answer for one whose
# connection closes: a collective fails on every survivor when a peer dies, and the dead rank is the cause.
ERROR_GRACE_S = 2.0


def _first_dead(pending: list[tuple[socket.socket, int]], grace_s: float) -> tuple[int, str] | None:
    """(rank, why) of the first of `pending` whose connection closes within `grace_s`, else None. Peeks only:
    an answer that arrives meanwhile is left unread (the caller is failing the step anyway)."""
    deadline = time.monotonic() + grace_s
    alive = dict(pending)
    while alive and time.monotonic() < deadline:
        ready, _, _ = select.select(list(alive), [], [], max(deadline - time.monotonic(), 0.0))
        for sock in ready:
            rank = alive.pop(sock)
            try:
                if sock.recv(1, socket.MSG_PEEK) == b"":
                    return rank, "connection closed"
            except OSError as e:
                return rank, str(e)
    return None


class RankFailure(RuntimeError):
    def __init__(self, rank: int, what: str, late: list[int] | None = None):
        super().__init__(what)
        self.rank, self.what, self.late = rank, what, late or [rank]


def _spin_until_readable(sock: socket.socket, spin_s: float) -> None:
    """Poll `sock` for up to `spin_s`; the blocking receive that follows then finds data waiting."""
    until = time.monotonic() + spin_s
    while time.monotonic() < until:
        if select.select([sock], [], [], 0.0)[0]:
            return


# What a handler returns for a message that has no answer of its own (a step waiting for its `fill`: the
# answer goes back after the fill).
NO_REPLY = object()


class _DriverGone(Exception):
    """The connection broke while a handler looked for the next message (`Later`)."""


Peek = Callable[[Callable[[], bool]], "tuple | None"]  # `Later`'s look at the next message


class Later:
    """What a handler returns for a message whose answer is still being computed (a step launched on the GPU,
    cluster/rank_worker.py). The loop calls `run(peek)`, which returns (answer, then): the answer is sent, and
    `then`, unless None, is called for what comes next (it returns what a handler returns). `peek(done)` gives the
    next message once it has come, or None once `done()` is true and none has: a message it gives is the
    `run`'s to handle (its answers follow this one's)."""

    def __init__(self, run: Callable[[Peek], tuple[Any, Callable[[], Any] | None]]):
        self.run = run


def _connect(address: tuple[str, int], local_path: str | None) -> socket.socket:
    """The driver's local socket when it is on this node (its abstract name exists only here), else TCP."""
    if local_path is not None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(local_path)
            return sock
        except OSError:  # another node (or another network namespace): no such name here
            sock.close()
    return socket.create_connection(address, timeout=60)


def run_rank_loop(address: tuple[str, int], rank: int, handle: Callable[[tuple], Any],
                  spin_s: float = 0.0, local_path: str | None = None) -> threading.Thread:
    """Rank side: connect to the driver and serve its messages on a daemon thread until it hangs up.
    `handle(message)` returns the answer (or NO_REPLY, or a `Later` that computes it and may take the next
    message meanwhile); an exception is sent back as an error and the loop goes on (the driver decides: a
    failed step makes it stop every rank). After each message the loop polls for the next one for up to
    `spin_s` before blocking. `local_path`: the driver's
    `StepChannel.local_path`, tried first."""
    _HANDLERS.append(handle)
    sock = _connect(address, local_path)
    sock.settimeout(None)
    _configure(sock)
    sock.sendall(struct.pack("<I", rank))

    def peek(done: Callable[[], bool]) -> tuple | None:
        try:
            while not select.select([sock], [], [], 0.0)[0]:
                if done():
                    return None
            return pickle.loads(recv_frame(sock))
        except (ChannelClosed, OSError) as e:
            raise _DriverGone() from e

    def serve(message: tuple) -> None:
        """Handle one message and send its answers: one, none (NO_REPLY), or a chain of them (`Later`)."""
        step: Callable[[], Any] | None = lambda: handle(message)  # noqa: E731
        while step is not None:
            try:
                answer, step = step(), None
                if isinstance(answer, Later):
                    answer, step = answer.run(peek)
                if answer is NO_REPLY:
                    continue
                reply = ("ok", answer)
            except _DriverGone:
                raise
            except BaseException as e:  # noqa: BLE001 - reported to the driver, which stops the replica
                reply, step = ("error", f"{e!r}\n{traceback.format_exc(limit=8)}"), None
            send_frame(sock, pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL))

    def loop() -> None:
        with sock:
            while True:
                if spin_s > 0:
                    _spin_until_readable(sock, spin_s)
                try:
                    serve(pickle.loads(recv_frame(sock)))
                except (ChannelClosed, OSError, _DriverGone):
                    return  # the driver shut down or died: nothing left to serve

    thread = threading.Thread(target=loop, name=f"tandem-rank{rank}-steps", daemon=True)
    thread.start()
    return thread

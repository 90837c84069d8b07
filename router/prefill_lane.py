"""The prefill lane: a direct TCP connection from a router replica to a prefill replica, beside Serve.

Router-driven prefill (router/disaggregated.py) calls the prefill pool through Serve, and its token 1 came
back through the same call: two Serve hops on the first token's path that a colocated replica does not
have. A Serve handle call costs milliseconds each way (on this project's 2-core CI box 3-5 ms into the
replica and 1-2 ms back for an empty method, against 0.05-0.2 ms each way on a local socket), and on the
GPU hosts PD's first token came 6-10 ms later than colocated's at 1-2 req/s (docs/benchmarks.md).

The lane takes both hops off that path without taking anything away from the Serve call:
1. the router sends `start` on the lane, then makes the Serve call (`prefill_first`), preferring the same
   replica (router/routing.py); the prefill replica begins the run at the lane's start;
2. the Serve call takes the run over when it arrives (`PrefillReplica.prefill_first`): the replica says
   `claimed` on the lane, and from then on the answer that call returns (which the decode replica gets,
   as before) is the run the lane reports on;
3. the replica sends `first` (token 1) on the lane as soon as the run has it; the router streams it once
   both `first` and `claimed` are in, and its decode replica has reserved the blocks.
Until `claimed`, token 1 might not be the one the decode replica goes on from (a Serve call that went to
another replica runs its own prefill), so the router waits for the Serve answer instead. A run no Serve
call claims is dropped by the router (its request over) or by the replica (`FIRST_CLAIM_S`, or the lane
closing). Everything else (errors, cancellation, the KV handoff, backpressure) stays the Serve call's.

Frames are a 4-byte length and a pickle; the connection opens with the replica's token (published with
its address in its routing stats, which only Serve's controller and routers read), so that a stranger on
the network cannot make the replica unpickle anything.
"""
from __future__ import annotations

import asyncio
import logging
import pickle
import secrets
import struct
import time
from dataclasses import dataclass, field
from typing import Any, Callable

from engine.disagg import PrefillReplica, streamable
from engine.llm_engine import RequestOutput

log = logging.getLogger(__name__)

HELLO_TIMEOUT_S = 5.0  # a connection that does not show the token within this is closed
CONNECT_TIMEOUT_S = 1.0  # the router's connect; an address that failed is not tried again for RETRY_AFTER_S
RETRY_AFTER_S = 5.0
MAX_FRAME = 64 << 20  # a prompt of 1M tokens pickles to ~5 MB
MAX_UNCLAIMED = 32  # lane-started runs on one replica that no Serve call has taken yet; more: refused
_LEN = struct.Struct("!I")


def _frame(message: tuple) -> bytes:
    body = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    return _LEN.pack(len(body)) + body


async def _read(reader: asyncio.StreamReader) -> tuple:
    (size,) = _LEN.unpack(await reader.readexactly(_LEN.size))
    if size > MAX_FRAME:
        raise ConnectionError(f"a lane frame of {size} bytes (at most {MAX_FRAME})")
    return pickle.loads(await reader.readexactly(size))


class LaneServer:
    """The prefill replica's end: `start(host)` on the replica's event loop (the one its Serve methods run on,
    since the runs it starts are `PrefillReplica`'s); `address` and `token` go into its routing stats."""

    def __init__(self, replica: PrefillReplica, admit: Callable[[], bool]):
        self.replica = replica
        self.admit = admit  # whether the replica takes one more run now (its load below the pool's limit)
        self.token = secrets.token_hex(16)
        self.address: str | None = None
        self.started = 0  # runs the lane has started (for tests and the trace)
        self._server: asyncio.AbstractServer | None = None

    async def start(self, host: str) -> str:
        if self._server is None:
            self._server = await asyncio.start_server(self._serve, host, 0)
            port = self._server.sockets[0].getsockname()[1]
            self.address = f"{host}:{port}"
        return self.address

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        mine: set[str] = set()  # runs this connection started: dropped unless claimed when it closes
        try:
            hello = await asyncio.wait_for(_read(reader), HELLO_TIMEOUT_S)
            if hello != ("hello", self.token):
                return
            while True:
                message = await _read(reader)
                if message[0] == "start":
                    self._start(writer, mine, *message[1:])
                elif message[0] == "drop":
                    mine.discard(message[1])
                    self.replica.drop_first(message[1])
        except (asyncio.IncompleteReadError, ConnectionError, asyncio.TimeoutError):
            pass  # the router went away (or never said hello)
        except Exception:  # noqa: BLE001 - a frame this replica cannot read: the connection ends, the replica serves on
            log.warning("prefill lane: closing a connection after a bad frame", exc_info=True)
        finally:
            for request_id in mine:
                self.replica.drop_first(request_id)
            writer.close()

    def _start(self, writer: asyncio.StreamWriter, mine: set[str], request_id: str, prompt: list[int], params: Any,
               priority: int) -> None:
        def send(message: tuple) -> None:
            if not writer.is_closing():
                writer.write(_frame(message))

        if self.replica.unclaimed_first_runs >= MAX_UNCLAIMED or not self.admit():
            send(("first", request_id, None))  # the Serve call runs it, as without a lane
            return
        task = self.replica.start_first(request_id, prompt, params, priority,
                                        on_claim=lambda: send(("claimed", request_id)))
        if task is None:
            send(("first", request_id, None))
            return
        self.started += 1
        mine.add(request_id)

        def done(task: asyncio.Task) -> None:
            mine.discard(request_id)
            ready = None if task.cancelled() or task.exception() is not None else task.result()
            send(("first", request_id, None if ready is None or ready.finished else streamable(ready.output)))

        task.add_done_callback(done)


@dataclass
class _Waiting:
    future: asyncio.Future  # token 1 (RequestOutput) once both `first` and `claimed` are in; None if not to come
    first: RequestOutput | None = None
    got_first: bool = False
    claimed: bool = False


@dataclass
class _Connection:
    writer: asyncio.StreamWriter
    reader_task: asyncio.Task | None = None
    waiting: dict[str, _Waiting] = field(default_factory=dict)


class LaneClient:
    """A router replica's ends of its lanes, one connection per prefill replica, opened at first use."""

    def __init__(self) -> None:
        self._connections: dict[str, _Connection] = {}
        self._connecting: dict[str, asyncio.Future] = {}
        self._failed_at: dict[str, float] = {}

    async def start(self, address: str, token: str, request_id: str, prompt: list[int], params: Any,
                    priority: int) -> asyncio.Future | None:
        """Send `start`; the future gives token 1 once the replica has it and its Serve call has claimed the
        run, or None when it will not (refused, finished at token 1, failed, the lane closed). None instead of a
        future when the lane is not open now (the first request to a replica opens it for the next ones)."""
        conn = await self._connection(address, token)
        if conn is None:
            return None
        waiting = conn.waiting[request_id] = _Waiting(asyncio.get_running_loop().create_future())
        try:
            conn.writer.write(_frame(("start", request_id, prompt, params, priority)))
        except Exception:  # noqa: BLE001 - the connection broke: the Serve call does it all
            conn.waiting.pop(request_id, None)
            return None
        return waiting.future

    def drop(self, address: str, request_id: str) -> None:
        """The request is over (or went on without the lane): forget it, and have the replica drop the run unless
        a Serve call has taken it."""
        conn = self._connections.get(address)
        if conn is None:
            return
        waiting = conn.waiting.pop(request_id, None)
        if waiting is not None and not waiting.future.done():
            waiting.future.set_result(None)
        try:
            if not conn.writer.is_closing():
                conn.writer.write(_frame(("drop", request_id)))
        except Exception:  # noqa: BLE001
            log.debug("dropping %s on the lane failed", request_id, exc_info=True)

    async def _connection(self, address: str, token: str) -> _Connection | None:
        """The open connection to `address`; None while there is none, which starts one in the background (no
        request waits for a connect: a lane being opened, or unreachable, is Serve calls only meanwhile)."""
        conn = self._connections.get(address)
        if conn is not None:
            return conn
        if time.monotonic() - self._failed_at.get(address, -RETRY_AFTER_S) < RETRY_AFTER_S:
            return None
        if address not in self._connecting:
            pending = self._connecting[address] = asyncio.ensure_future(self._connect(address, token))
            pending.add_done_callback(lambda _: self._connecting.pop(address, None))
        return None

    async def _connect(self, address: str, token: str) -> _Connection | None:
        host, port = address.rsplit(":", 1)
        try:
            reader, writer = await asyncio.wait_for(asyncio.open_connection(host, int(port)), CONNECT_TIMEOUT_S)
            writer.write(_frame(("hello", token)))
        except (OSError, asyncio.TimeoutError) as e:
            log.info("prefill lane %s unreachable (%r); Serve calls only for %.0fs", address, e, RETRY_AFTER_S)
            self._failed_at[address] = time.monotonic()
            return None
        conn = self._connections[address] = _Connection(writer)
        conn.reader_task = asyncio.ensure_future(self._read_answers(address, conn, reader))
        return conn

    async def _read_answers(self, address: str, conn: _Connection, reader: asyncio.StreamReader) -> None:
        try:
            while True:
                kind, request_id, *rest = await _read(reader)
                waiting = conn.waiting.get(request_id)
                if waiting is None or waiting.future.done():
                    continue
                if kind == "claimed":
                    waiting.claimed = True
                elif kind == "first":
                    waiting.got_first, waiting.first = True, rest[0]
                if waiting.got_first and (waiting.first is None or waiting.claimed):
                    waiting.future.set_result(waiting.first)
        except (asyncio.IncompleteReadError, ConnectionError, pickle.UnpicklingError, ValueError):
            pass
        finally:  # the replica went away: every request waiting on it takes token 1 from its Serve answer
            if self._connections.get(address) is conn:
                del self._connections[address]
            for waiting in conn.waiting.values():
                if not waiting.future.done():
                    waiting.future.set_result(None)
            conn.waiting.clear()
            conn.writer.close()

    def close(self) -> None:
        for conn in list(self._connections.values()):
            conn.writer.close()
            if conn.reader_task is not None:
                conn.reader_task.cancel()

"""Running a script under Triton's interpreter (TRITON_INTERPRET=1), for the kernel tests on CPU. In a
process of its own, since the variable must be set before the kernels are defined.

Each script runs in a child forked from one server process per test session, which was started with
TRITON_INTERPRET=1 and has imported torch, Triton and the kernel modules once: a `python -c` per script
spent 3 s (of 3-15 s) importing them again on 2 cores. The child is what `python -c script` would be, as far as
the script can tell: `__name__ == "__main__"`, its own stdout and stderr, its exit status, nothing left over
from any other script (the server itself runs no kernel, and every child starts from it).

Running ahead on the idle core: CI has 2 cores, and the rest of the suite (Ray actors, servers, engines that wait
on each other) leaves about one of them idle (vmstat during a run: 40-55% idle), while an interpreted script keeps
one core busy for 10-70 s. A test marked `@pytest.mark.interpreted(SCRIPT, timeout=...)` has its script run
ahead, from the end of collection and last test first, by a second server at the lowest CPU priority (nice 19),
so it only takes CPU the other tests leave. When the test comes, `run_interpreted` takes that run's result
(waiting if it is under way), or, if its turn has not come, runs the script itself as before; a run ahead that
timed out or lost its server is run again by the test. Only the selected tests' scripts run ahead (`-k`, paths).
TANDEM_TEST_RUN_AHEAD=0 turns it off.
"""
from __future__ import annotations

import atexit
import contextlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

# Imported once by the server, before it forks; a module that fails to import is left to the script.
PRELOAD = ("numpy", "torch", "torch.nn.functional", "triton", "parallel.state", "parallel.ring_attention",
           "parallel.ulysses", "parallel.kernels.gemv", "parallel.kernels.fused_moe", "parallel.kernels.quant_gemm",
           "parallel.kernels.int4pack", "parallel.kernels.ring_attention_triton", "parallel.quant.awq",
           "parallel.quant.gptq", "parallel.quant.packed", "parallel.quant.rtn", "parallel.quant.tinygemm",
           "workers.sp_plan", "workers.models.moe")

# One request per line on stdin ({"script", "out", "err"}); answers on stdout: {"pid"} once the child is
# forked, {"status"} (as subprocess gives returncode) once it has exited.
_SERVER = r'''
import json, os, sys, traceback
for name in sys.argv[1].split(","):
    try:
        __import__(name)
    except Exception:
        pass
for line in sys.stdin:
    req = json.loads(line)
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            null = os.open(os.devnull, os.O_RDONLY)
            os.dup2(null, 0)
            os.dup2(os.open(req["out"], os.O_WRONLY), 1)
            os.dup2(os.open(req["err"], os.O_WRONLY), 2)
            sys.argv = ["-c"]
            try:
                exec(compile(req["script"], "<string>", "exec"), {"__name__": "__main__", "__builtins__": __builtins__})
                code = 0
            except SystemExit as e:  # as the interpreter exits on it
                if e.code is None or isinstance(e.code, int):
                    code = e.code or 0
                else:
                    print(e.code, file=sys.stderr)
            except BaseException:
                traceback.print_exc()
        finally:
            try:
                sys.stdout.flush()
                sys.stderr.flush()
            finally:
                os._exit(code)
    print(json.dumps({"pid": pid}), flush=True)
    _, status = os.waitpid(pid, 0)
    print(json.dumps({"status": os.waitstatus_to_exitcode(status)}), flush=True)
'''


class _Server:
    def __init__(self, nice: int = 0, preload: tuple[str, ...] = PRELOAD) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, ",".join(preload)], env=env, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0,
                                     preexec_fn=(lambda: os.nice(nice)) if nice else None)
        self.pending = b""
        self.child: int | None = None  # the script's process while one runs
        atexit.register(self.close)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def answer(self, timeout: float | None) -> dict | None:
        """The server's next line, or None if none came within `timeout` seconds."""
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.pending:
            if not select.select([fd], [], [], timeout)[0]:
                return None
            chunk = os.read(fd, 65536)
            if not chunk:
                raise RuntimeError(f"the interpreter server exited ({self.proc.wait()})")
            self.pending += chunk
        line, self.pending = self.pending.split(b"\n", 1)
        return json.loads(line)

    def run(self, script: str, timeout: float) -> tuple[int, str, str]:
        with tempfile.TemporaryDirectory() as d:
            out, err = Path(d, "out"), Path(d, "err")
            out.touch()
            err.touch()
            self.proc.stdin.write((json.dumps({"script": script, "out": str(out), "err": str(err)}) + "\n").encode())
            pid = self.child = self.answer(None)["pid"]
            try:
                done = self.answer(timeout)
                if done is None:
                    os.kill(pid, signal.SIGKILL)
                    self.answer(None)
                    raise subprocess.TimeoutExpired([sys.executable, "-c", script], timeout)
            finally:
                self.child = None
            return done["status"], out.read_text(), err.read_text()

    def close(self) -> None:
        child = self.child
        if child is not None:  # a script still running (a run ahead at the session's end): not left orphaned
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


@dataclass(eq=False)
class _Ahead:
    """One script's run ahead: queued -> running -> done, or taken (its test came first and runs it itself)."""
    script: str
    timeout: float
    state: str = "queued"
    result: tuple[int, str, str] | None = None  # (exit status, stdout, stderr) of a run that finished
    finished: threading.Event = field(default_factory=threading.Event)


class RunAhead:
    """Runs queued scripts one at a time on a server of its own at CPU priority `nice`, in a daemon thread."""

    def __init__(self, jobs: list[tuple[str, float]], nice: int = 19, preload: tuple[str, ...] = PRELOAD) -> None:
        self.lock = threading.Lock()
        self.jobs: dict[str, _Ahead] = {}
        for script, timeout in jobs:
            self.jobs.setdefault(script, _Ahead(script, timeout))
        self.nice, self.preload = nice, preload
        self.server: _Server | None = None
        self.stopped = False
        self.thread = threading.Thread(target=self._loop, name="interpreter-run-ahead", daemon=True)
        self.thread.start()

    def _next(self) -> _Ahead | None:
        """The queued job whose test comes last: the first ones' tests come soon and run them themselves."""
        with self.lock:
            for job in reversed(self.jobs.values()):
                if job.state == "queued" and not self.stopped:
                    job.state = "running"
                    return job
        return None

    def _loop(self) -> None:
        while (job := self._next()) is not None:
            try:
                if self.server is None or not self.server.alive():
                    self.server = _Server(self.nice, self.preload)
                job.result = self.server.run(job.script, job.timeout)
            except Exception:  # timed out at low priority, or the server died: the test runs it itself
                job.result = None
            job.state = "done"
            job.finished.set()

    def take(self, script: str) -> tuple[int, str, str] | None:
        """The script's result from its run ahead (waiting for a run under way), or None: the caller runs it."""
        with self.lock:
            job = self.jobs.get(script)
            if job is None or job.state == "queued":
                if job is not None:
                    job.state = "taken"
                return None
        job.finished.wait()
        return job.result

    def close(self) -> None:
        with self.lock:
            self.stopped = True
        if self.server is not None:
            self.server.close()


_server: _Server | None = None
_ahead: RunAhead | None = None


# script -> the timeout its test's marker gives (`run_ahead`): `run_interpreted` takes it from here, so a test states it once.
_MARKED_TIMEOUTS: dict[str, float] = {}


def run_ahead(jobs: list[tuple[str, float]]) -> None:
    """Start running these (script, timeout) pairs ahead (tests/conftest.py, after collection); see the top."""
    global _ahead
    _MARKED_TIMEOUTS.update(jobs)
    if jobs and _ahead is None and os.environ.get("TANDEM_TEST_RUN_AHEAD", "1") != "0":
        if importlib.util.find_spec("triton") is None:  # every interpreted test skips
            return
        _ahead = RunAhead(jobs)


def stop_run_ahead() -> None:
    if _ahead is not None:
        _ahead.close()


def run_interpreted(script: str, timeout: float | None = None) -> str:
    """Run `script` (Python source) with TRITON_INTERPRET=1 from the repository root; its stdout. A failure
    fails the calling test with the script's stderr; without Triton the test is skipped. A script run ahead
    (see the top) gives that run's result. timeout: by default the one its test's `interpreted` marker gives
    (else 900 s)."""
    global _server
    if timeout is None:
        timeout = _MARKED_TIMEOUTS.get(script, 900)
    pytest.importorskip("triton")
    result = _ahead.take(script) if _ahead is not None else None
    if result is None:
        if _server is None or not _server.alive():
            _server = _Server()
        result = _server.run(script, timeout)
    returncode, stdout, stderr = result
    assert returncode == 0, stderr[-3000:]
    return stdout

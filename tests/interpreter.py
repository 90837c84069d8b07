"""Running a script under Triton's interpreter (TRITON_INTERPRET=1), for the kernel tests on CPU. In a
process of its own, since the variable must be set before the kernels are defined.

Each script runs in a child forked from one server process per test session, which was started with
TRITON_INTERPRET=1 and has imported torch, Triton and the kernel modules once: a `python -c` per script
spent 3 s (of 3-15 s) importing them again on 2 cores. The child is what `python -c script` would be, as far as
the script can tell: `__name__ == "__main__"`, its own stdout and stderr, its exit status, nothing left over
from any other script (the server itself runs no kernel, and every child starts from it).
"""
from __future__ import annotations

import atexit
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
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
    def __init__(self) -> None:
        env = {**os.environ, "TRITON_INTERPRET": "1", "PYTHONPATH": str(ROOT)}
        self.proc = subprocess.Popen([sys.executable, "-c", _SERVER, ",".join(PRELOAD)], env=env, cwd=ROOT,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0)
        self.pending = b""
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
            pid = self.answer(None)["pid"]
            done = self.answer(timeout)
            if done is None:
                os.kill(pid, signal.SIGKILL)
                self.answer(None)
                raise subprocess.TimeoutExpired([sys.executable, "-c", script], timeout)
            return done["status"], out.read_text(), err.read_text()

    def close(self) -> None:
        if self.alive():
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()


_server: _Server | None = None


def run_interpreted(script: str, timeout: float = 900) -> str:
    """Run `script` (Python source) with TRITON_INTERPRET=1 from the repository root; its stdout. A failure
    fails the calling test with the script's stderr; without Triton the test is skipped."""
    global _server
    pytest.importorskip("triton")
    if _server is None or not _server.alive():
        _server = _Server()
    returncode, stdout, stderr = _server.run(script, timeout)
    assert returncode == 0, stderr[-3000:]
    return stdout

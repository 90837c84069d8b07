"""tests/interpreter.py's run ahead: interpreted scripts run early on a low-priority server, and a test either
takes that run's result or runs its script itself. Plain Python scripts here (no kernels, no preloads)."""
from __future__ import annotations

import os
import time

from tests.interpreter import RunAhead

NICE = "import os; print('nice', os.nice(0))"


def _wait(cond, seconds: float = 60.0) -> None:
    end = time.monotonic() + seconds
    while not cond():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.05)


def _started(ahead: RunAhead, script: str) -> bool:
    return ahead.jobs[script].state != "queued"


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie has exited
    except FileNotFoundError:
        return False


def test_a_script_run_ahead_at_low_priority_gives_its_result_to_its_test():
    failing = "import sys; sys.exit(3)"
    ahead = RunAhead([(failing, 60), (NICE, 60)], preload=())  # the last test's script first
    try:
        _wait(lambda: _started(ahead, NICE))
        status, out, _ = ahead.take(NICE)  # waits for the run under way
        assert status == 0 and out.split() == ["nice", str(min(os.nice(0) + 19, 19))]
        _wait(lambda: ahead.jobs[failing].state == "done")
        assert ahead.take(failing)[0] == 3  # a failing script's status comes back to its test
    finally:
        ahead.close()


def test_a_test_that_comes_first_runs_its_script_itself_and_it_is_not_run_again():
    slow, sooner = "import time; time.sleep(1.5); print('slow')", "print('sooner')"
    ahead = RunAhead([(sooner, 60), (slow, 60)], preload=())  # `slow`'s test comes last: its script runs first
    try:
        assert ahead.take(sooner) is None  # still queued behind `slow`: the caller runs it
        _wait(lambda: _started(ahead, slow))
        assert ahead.take(slow)[1].strip() == "slow"
        ahead.thread.join(30)
        assert not ahead.thread.is_alive() and ahead.jobs[sooner].state == "taken" and ahead.jobs[sooner].result is None
        assert ahead.take("print('never queued')") is None
    finally:
        ahead.close()


def test_a_run_ahead_past_its_timeout_is_left_to_the_test():
    stuck = "import time; time.sleep(30)"
    ahead = RunAhead([(stuck, 0.5)], preload=())
    try:
        _wait(lambda: _started(ahead, stuck))
        assert ahead.take(stuck) is None  # killed at its timeout: the test runs it itself, with its own limit
        assert ahead.jobs[stuck].state == "done"
    finally:
        ahead.close()


def test_closing_kills_a_script_still_running_ahead():
    long = "import time; time.sleep(60)"
    ahead = RunAhead([(long, 120)], preload=())
    _wait(lambda: ahead.server is not None and ahead.server.child is not None)
    child, server = ahead.server.child, ahead.server.proc
    assert _alive(child)
    ahead.close()
    _wait(lambda: server.poll() is not None, 20)  # the server reaped its killed child and left
    assert not _alive(child)


def test_a_script_takes_the_timeout_its_marker_gives(monkeypatch):
    """`@pytest.mark.interpreted(SCRIPT, timeout=...)` states the timeout once: `run_interpreted(SCRIPT)` uses it."""
    import pytest

    from tests import interpreter

    pytest.importorskip("triton")
    seen = []

    class _Recording:
        def alive(self) -> bool:
            return True

        def run(self, script: str, timeout: float):
            seen.append(timeout)
            return 0, "ok", ""

    monkeypatch.setenv("TANDEM_TEST_RUN_AHEAD", "0")  # registers the timeouts, runs nothing ahead
    monkeypatch.setattr(interpreter, "_ahead", None)
    monkeypatch.setattr(interpreter, "_server", _Recording())
    monkeypatch.setattr(interpreter, "_MARKED_TIMEOUTS", {})
    interpreter.run_ahead([("print('marked')", 123)])
    assert interpreter.run_interpreted("print('marked')") == "ok"
    assert interpreter.run_interpreted("print('unmarked')") == "ok"
    assert interpreter.run_interpreted("print('marked')", timeout=7) == "ok"
    assert seen == [123, 900, 7]

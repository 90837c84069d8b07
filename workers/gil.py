"""How long a thread that computes in Python keeps the GIL from threads that wait for it.

CPython's default switch interval is 5 ms: a thread that let the GIL go (a socket call, a CUDA synchronise,
a sleep, a collective) waits up to that long to get it back from a thread that is running Python. An engine
process has such a thread, the step loop, beside threads that mostly wait: a KV transfer's sends, receives
and polls, Ray's calls into a rank actor, the event loop that streams tokens. At 5 ms each of their GIL
releases cost up to 5 ms: beside a busy thread, 20 releases took 105 ms at the default and 6.4 ms at 0.1 ms
(scripts/bench_gil_switch.py, docs/benchmarks.md). On 2 x H100 under load a 1.4K-token KV push took 88 ms
at the default, where the transfer alone takes about 1 ms; GIL turns are the suspected share of it (not yet
measured on GPUs with this change). A shorter interval costs the busy thread a switch only while another thread
is waiting for the GIL.
"""
from __future__ import annotations

import os
import sys

SWITCH_INTERVAL_S = 1e-4
ENV = "TANDEM_GIL_SWITCH_INTERVAL_S"  # overrides SWITCH_INTERVAL_S (e.g. 0.005: CPython's default, to compare)


def shorten_switch_interval() -> float:
    """Set this process's GIL switch interval (SWITCH_INTERVAL_S, or $TANDEM_GIL_SWITCH_INTERVAL_S); returns it."""
    raw = os.environ.get(ENV)
    try:
        interval = float(raw) if raw else SWITCH_INTERVAL_S
        if interval <= 0:
            raise ValueError
    except ValueError:
        raise ValueError(f"{ENV} must be a positive number of seconds, not {raw!r}") from None
    sys.setswitchinterval(interval)
    return interval

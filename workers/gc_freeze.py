"""Start-up's objects out of the cyclic garbage collector's reach, and its pauses measured.

An engine process holds a few hundred thousand objects that live as long as it does: the model's modules
and parameters, the tokenizer's tables, Ray's and torch's own state. CPython's collector walks all of them in
each full collection, and its step loop stands still meanwhile; under TP the peer ranks wait in their next
collective for it. On the shipped tiny model (CPU, TP=2, 500 requests) the driver held ~400K tracked objects
and one full collection during the run took 241 ms. `gc.freeze()` after start-up (what vLLM's engine does)
moves them to a permanent generation that no collection walks; only what serving allocates later is
collected. TANDEM_GC_FREEZE=0 leaves the collector as it is (read by the driver and, forwarded, by the ranks).
"""
from __future__ import annotations

import gc
import os
import time

GC_FREEZE_ENV = "TANDEM_GC_FREEZE"


def gc_freeze_enabled(environ: dict[str, str] | None = None) -> bool:
    return (os.environ if environ is None else environ).get(GC_FREEZE_ENV, "1").strip() != "0"


def freeze_startup_objects() -> bool:
    """Collect start-up's garbage once, then freeze what survives; returns whether it froze (the switch)."""
    if not gc_freeze_enabled():
        return False
    gc.collect()
    gc.freeze()
    return True


class GcPauses:
    """The collector's pauses in this process while it is installed, per generation: count, total and
    longest seconds (`gc.callbacks`; a profile's view of what the step loop lost to collections)."""

    def __init__(self) -> None:
        self.count = [0, 0, 0]
        self.total_s = [0.0, 0.0, 0.0]
        self.max_s = [0.0, 0.0, 0.0]
        self._started = 0.0

    def _callback(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        g, took = info["generation"], time.perf_counter() - self._started
        self.count[g] += 1
        self.total_s[g] += took
        self.max_s[g] = max(self.max_s[g], took)

    def install(self) -> "GcPauses":
        if self._callback not in gc.callbacks:
            gc.callbacks.append(self._callback)
        return self

    def remove(self) -> None:
        if self._callback in gc.callbacks:
            gc.callbacks.remove(self._callback)

    def summary(self) -> dict:
        """{"collections": n, "ms_total": .., "ms_max": .., "full": n of generation 2}."""
        return {"collections": sum(self.count), "ms_total": 1e3 * sum(self.total_s), "ms_max": 1e3 * max(self.max_s),
                "full": self.count[2]}

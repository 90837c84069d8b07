"""Start-up's objects frozen out of the collector (workers/gc_freeze.py), its switch, and the pause counter the
step profiles report."""
from __future__ import annotations

import gc

from workers.gc_freeze import GC_FREEZE_ENV, GcPauses, freeze_startup_objects, gc_freeze_enabled


def test_freeze_moves_what_lives_out_of_the_collector_and_the_switch_keeps_it_in(monkeypatch):
    gc.unfreeze()  # an engine built earlier in this process froze its own objects
    try:
        monkeypatch.setenv(GC_FREEZE_ENV, "0")
        assert not gc_freeze_enabled() and not freeze_startup_objects()
        assert gc.get_freeze_count() == 0
        monkeypatch.setenv(GC_FREEZE_ENV, "1")
        kept = [object() for _ in range(1000)]
        assert freeze_startup_objects()
        assert gc.get_freeze_count() >= len(kept)
    finally:
        gc.unfreeze()
    assert gc_freeze_enabled({}) and not gc_freeze_enabled({GC_FREEZE_ENV: " 0 "})


def test_pauses_are_counted_while_installed_only():
    pauses = GcPauses().install()
    try:
        gc.collect(0)
        gc.collect()
    finally:
        pauses.remove()
    seen = pauses.summary()
    assert seen["collections"] >= 2 and seen["full"] >= 1 and seen["ms_total"] > 0 and seen["ms_max"] > 0
    gc.collect()
    assert pauses.summary() == seen

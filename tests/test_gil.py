"""The engine's processes shorten the GIL switch interval (workers/gil.py): a rank actor and the served
engine's process set it when they start, $TANDEM_GIL_SWITCH_INTERVAL_S overrides it, and a bad value is
an error that names the variable."""
from __future__ import annotations

import sys

import pytest

from workers import gil


@pytest.fixture(autouse=True)
def _restore_interval():
    before = sys.getswitchinterval()
    yield
    sys.setswitchinterval(before)


def test_the_default_is_short_and_the_environment_overrides_it(monkeypatch):
    sys.setswitchinterval(0.005)
    monkeypatch.delenv(gil.ENV, raising=False)
    assert gil.shorten_switch_interval() == gil.SWITCH_INTERVAL_S
    assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_INTERVAL_S)
    monkeypatch.setenv(gil.ENV, "0.002")
    assert gil.shorten_switch_interval() == 0.002
    assert sys.getswitchinterval() == pytest.approx(0.002)


@pytest.mark.parametrize("raw", ["fast", "0", "-1"])
def test_a_bad_override_names_the_variable(monkeypatch, raw):
    monkeypatch.setenv(gil.ENV, raw)
    with pytest.raises(ValueError, match=f"{gil.ENV} must be a positive number of seconds, not '{raw}'"):
        gil.shorten_switch_interval()


def test_a_rank_actor_and_the_served_engine_set_it(monkeypatch):
    from cluster.rank_worker import RankWorker
    from engine.async_engine import AsyncEngine

    monkeypatch.delenv(gil.ENV, raising=False)
    sys.setswitchinterval(0.005)
    RankWorker(0)
    assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_INTERVAL_S)
    sys.setswitchinterval(0.005)
    AsyncEngine(engine=None)
    assert sys.getswitchinterval() == pytest.approx(gil.SWITCH_INTERVAL_S)

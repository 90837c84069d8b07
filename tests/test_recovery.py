"""Faster recovery (issue 19 item 6, part): engine replicas are health-checked every 2 s, not Serve's 10 s, so
a replica whose engine died (a rank process lost, while the replica actor lives on) leaves the routing
tables, and is replaced, within about 2 s instead of answering 503 for up to 10 s."""
from __future__ import annotations

import pytest
from pydantic import ValidationError

from router.app import build_app
from router.config import AppConfig


def _engine_deployments(app) -> dict[str, object]:
    """name -> deployment config of the engine deployments of a built app (the Router's bound pools, or
    the colocated deployment itself)."""
    top = app._bound_deployment
    pools = [a._bound_deployment for a in top.init_args[1:]] if top.name == "Router" else [top]
    return {d.name: d._deployment_config for d in pools}


@pytest.mark.parametrize("args", [{}, {"colocated": True}], ids=["disaggregated", "colocated"])
def test_engine_replicas_are_health_checked_every_2s_by_default(args):
    deployments = _engine_deployments(build_app(args))
    assert set(deployments) == ({"TandemColocated"} if args else {"PrefillPool", "DecodePool"})
    for name, cfg in deployments.items():
        assert (cfg.health_check_period_s, cfg.health_check_timeout_s) == (2.0, 10.0), name


def test_health_check_options_per_pool_and_checked():
    config = AppConfig(prefill={"health_check_period_s": 0.5, "num_replicas": 2},
                       decode={"autoscaling_config": {"min_replicas": 1, "max_replicas": 2}, "health_check_timeout_s": 4})
    assert config.prefill.serve_options() == {"num_replicas": 2, "health_check_period_s": 0.5,
                                              "health_check_timeout_s": 10.0}
    assert config.decode.serve_options()["health_check_timeout_s"] == 4
    assert config.prefill.engine_overrides() == {}  # not mistaken for engine arguments
    with pytest.raises(ValidationError):
        AppConfig(decode={"health_check_period_s": 0})

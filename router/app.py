"""The Ray Serve application: `build_app(args)` is the `import_path` of deploy/serve_config.yaml.

`args` are validated as `AppConfig`. With `colocated: true` the app is one ingress deployment whose
replicas each run a whole engine (router/colocated.py). Otherwise the disaggregated router (prefill
pool -> KV handoff -> decode pool, router/disaggregated.py) serves the same two front ends.
"""
from __future__ import annotations

from typing import Any

from ray.serve import Application

from router.config import AppConfig


def build_app(args: dict[str, Any] | None = None) -> Application:
    config = AppConfig.model_validate(args or {})
    if config.colocated:
        from router.colocated import build_colocated_app

        return build_colocated_app(config)
    from router.disaggregated import build_disaggregated_app  # the pools and the KV handoff

    return build_disaggregated_app(config)

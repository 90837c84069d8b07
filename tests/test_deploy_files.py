"""Deployment files are checked against the schemas of the tools that read them, so that a typo fails
here and not on a cluster: `ray up` (ray-schema.json), Serve (ServeDeploySchema, plus a check for
keys Serve would silently ignore), Tandem's AppConfig, KubeRay's RayService CRD (with unknown fields
forbidden, as `kubectl apply --validate=strict` would) and the Grafana dashboard's metric names."""
from __future__ import annotations

import copy
import importlib
import json
import re
import typing
from pathlib import Path

import jsonschema
import pytest
import yaml
from pydantic import BaseModel

import ray
from router.config import AppConfig
from router.metrics import METRICS

REPO = Path(__file__).resolve().parents[1]
# CI runs in a clean clone with shared/ beside it; a developer checkout has it at the same place.
SCHEMAS = REPO.parent / "shared" / "schemas"
RAY_SCHEMA = Path(ray.__file__).parent / "autoscaler" / "ray-schema.json"


def _yaml(rel: str):
    return yaml.safe_load((REPO / rel).read_text())


# ---------------------------------------------------------------- ray up


@pytest.mark.parametrize("rel", ["cluster/cluster.yaml", "cluster/cluster-local.yaml"])
def test_cluster_yaml_matches_the_launcher_schema(rel):
    from ray.autoscaler._private.util import validate_config

    config = _yaml(rel)
    jsonschema.validate(config, json.loads(RAY_SCHEMA.read_text()))
    if config["provider"]["type"] == "local":
        # The local provider rewrites node types itself and rejects configs that set them.
        from ray.autoscaler._private.local.config import prepare_local

        config, _ = prepare_local(config)
    # The launcher's further checks (head type listed, min_workers within max_workers, ...); it
    # expects the defaults it fills in, such as cluster_synced_files.
    validate_config({"cluster_synced_files": [], **config})
    setup = " ".join(config["setup_commands"])
    assert "pip install" in setup and "~/tandem" in setup and "router.proto" in setup
    assert config["file_mounts"] == {"~/tandem": "."}


def test_aws_cluster_has_gpu_workers_for_both_pools():
    config = _yaml("cluster/cluster.yaml")
    serve_args = _yaml("deploy/serve_config.yaml")["applications"][0]["args"]
    app = AppConfig.model_validate(serve_args)
    workers = {k: v for k, v in config["available_node_types"].items() if k != config["head_node_type"]}
    assert config["available_node_types"][config["head_node_type"]]["resources"] == {"CPU": 0}
    need = sum(_max_replicas(app.pool(n)) * app.engine_args(n).parallel_config().world_size for n in ("prefill", "decode"))
    assert sum(t["max_workers"] for t in workers.values()) >= need  # one GPU per worker node


# ---------------------------------------------------------------- Serve


def _model_fields(annotation) -> type[BaseModel] | None:
    """The pydantic model inside Optional[...] / List[...] / Union[...], if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    for arg in typing.get_args(annotation):
        found = _model_fields(arg)
        if found is not None:
            return found
    return None


def _unknown_keys(model: type[BaseModel], data, path: str = "") -> list[str]:
    """Keys that `model` does not define; Serve's schemas ignore them, which hides typos."""
    if isinstance(data, list):
        return [k for i, item in enumerate(data) for k in _unknown_keys(model, item, f"{path}[{i}]")]
    if not isinstance(data, dict):
        return []
    names = {f.alias or n: f for n, f in model.model_fields.items()} | dict(model.model_fields)
    bad = [f"{path}.{k}" for k in data if k not in names]
    for key, value in data.items():
        field = names.get(key)
        nested = _model_fields(field.annotation) if field is not None else None
        if nested is not None and key != "args":
            bad += _unknown_keys(nested, value, f"{path}.{key}")
    return bad


def _check_serve_config(config: dict) -> AppConfig:
    from ray.serve.schema import ServeDeploySchema

    ServeDeploySchema.model_validate(config)
    assert _unknown_keys(ServeDeploySchema, config) == []
    assert config["grpc_options"]["port"] == 9000
    [servicer] = config["grpc_options"]["grpc_servicer_functions"]
    module, name = servicer.rsplit(".", 1)
    assert callable(getattr(importlib.import_module(module), name))
    [application] = config["applications"]
    module, name = application["import_path"].split(":")
    assert callable(getattr(importlib.import_module(module), name))
    return AppConfig.model_validate(application["args"])


def test_serve_config_matches_serve_and_app_config():
    app = _check_serve_config(_yaml("deploy/serve_config.yaml"))
    assert not app.colocated and app.api_keys_env == "TANDEM_API_KEYS"
    assert app.prefill.autoscaling_config and app.decode.autoscaling_config


def test_a_typo_in_serve_config_is_caught():
    from ray.serve.schema import ServeDeploySchema

    config = _yaml("deploy/serve_config.yaml")
    bad = copy.deepcopy(config)
    bad["grpc_options"]["grpc_servicer_function"] = bad["grpc_options"].pop("grpc_servicer_functions")
    assert _unknown_keys(ServeDeploySchema, bad) == [".grpc_options.grpc_servicer_function"]
    args = copy.deepcopy(config["applications"][0]["args"])
    args["decode"]["autoscaling_config"]["max_replica"] = 3
    with pytest.raises(ValueError, match="max_replica"):
        AppConfig.model_validate(args)


# ---------------------------------------------------------------- KubeRay


def _forbid_unknown(schema):
    """additionalProperties: false on every object schema with properties and no
    x-kubernetes-preserve-unknown-fields (shared/schemas/README.md)."""
    if isinstance(schema, dict):
        if "properties" in schema and not schema.get("x-kubernetes-preserve-unknown-fields") \
                and "additionalProperties" not in schema:
            schema["additionalProperties"] = False
        for value in schema.values():
            _forbid_unknown(value)
    elif isinstance(schema, list):
        for item in schema:
            _forbid_unknown(item)
    return schema


@pytest.fixture(scope="module")
def rayservice_crd():
    path = SCHEMAS / "kuberay-rayservice-crd.yaml"
    if not path.exists():
        pytest.skip(f"KubeRay CRD schemas not found at {SCHEMAS} (shared/ must sit beside the repository root)")
    # 1 MB of YAML: the C loader when PyYAML has it.
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    version = next(v for v in crd["spec"]["versions"] if v["name"] == "v1")
    return crd, _forbid_unknown(version["schema"]["openAPIV3Schema"])


def test_rayservice_matches_the_crd(rayservice_crd):
    crd, schema = rayservice_crd
    manifest = _yaml("deploy/kuberay/rayservice.yaml")
    assert manifest["apiVersion"] == f"{crd['spec']['group']}/v1" and manifest["kind"] == crd["spec"]["names"]["kind"]
    jsonschema.validate(manifest["spec"], schema["properties"]["spec"])
    cluster = manifest["spec"]["rayClusterConfig"]
    assert cluster["enableInTreeAutoscaling"] is True
    assert cluster["rayVersion"] == ray.__version__


def test_a_misspelt_rayservice_field_is_caught(rayservice_crd):
    _, schema = rayservice_crd
    spec = _yaml("deploy/kuberay/rayservice.yaml")["spec"]
    spec["rayClusterConfig"]["workerGroupSpecs"][0]["maxReplica"] = 4
    with pytest.raises(jsonschema.ValidationError, match="maxReplica"):
        jsonschema.validate(spec, schema["properties"]["spec"])


def _max_replicas(pool) -> int:
    return pool.autoscaling_config["max_replicas"] if pool.autoscaling_config else (pool.num_replicas or 1)


def _gpus_per_pod(group: dict) -> int:
    limits = group["template"]["spec"]["containers"][0]["resources"]["limits"]
    return int(limits.get("nvidia.com/gpu", 0))


def test_rayservice_serve_config_and_worker_groups_fit_the_pools():
    manifest = _yaml("deploy/kuberay/rayservice.yaml")
    app = _check_serve_config(yaml.safe_load(manifest["spec"]["serveConfigV2"]))
    groups = manifest["spec"]["rayClusterConfig"]["workerGroupSpecs"]
    for name, pool in (("prefill", app.prefill), ("decode", app.decode)):
        # The groups that offer this pool's custom resources (all GPU groups when it asks for none).
        args = app.engine_args(name)
        hosts = [g for g in groups if all(k in g.get("resources", {}) for k in args.rank_resources) and _gpus_per_pod(g)]
        assert hosts, f"no worker group provides {name}'s rank_resources {args.rank_resources}"
        ranks = _max_replicas(pool) * args.parallel_config().world_size
        assert sum(g["maxReplicas"] * _gpus_per_pod(g) for g in hosts) >= ranks, name
        min_ranks = (pool.autoscaling_config or {}).get("min_replicas", 1) * args.parallel_config().world_size
        assert sum(g["minReplicas"] * _gpus_per_pod(g) for g in hosts) >= min_ranks, name


# ---------------------------------------------------------------- Grafana


def _exported_names(name: str, metric) -> set[str]:
    """The Prometheus series names Ray exports for one ray.util.metrics object."""
    from ray.util.metrics import Counter, Histogram

    if isinstance(metric, Histogram):
        return {f"ray_{name}_{suffix}" for suffix in ("bucket", "sum", "count")}
    if isinstance(metric, Counter):
        return {f"ray_{name}" if name.endswith("_total") else f"ray_{name}_total"}
    return {f"ray_{name}"}


def test_grafana_dashboard_uses_only_defined_metrics():
    dashboard = json.loads((REPO / "deploy/grafana/tandem-dashboard.json").read_text())
    exprs = [t["expr"] for p in dashboard["panels"] for t in p["targets"]]
    exprs += [v["definition"] for v in dashboard["templating"]["list"] if "definition" in v]
    used = {m for e in exprs for m in re.findall(r"\b(ray_tandem_[a-z0-9_]+)", e)}
    exported = {n: name for name, metric in METRICS.items() for n in _exported_names(name, metric)}
    assert used <= set(exported), f"the dashboard queries metrics the code does not define: {used - set(exported)}"
    assert {exported[n] for n in used} == set(METRICS), "every metric has a panel"
    assert all(name.startswith("tandem_") for name in METRICS)
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))


# ---------------------------------------------------------------- the image


def test_dockerfile_copies_existing_paths_and_builds_the_stubs():
    text = (REPO / "deploy/Dockerfile").read_text()
    for line in text.splitlines():
        if line.startswith("COPY"):
            *sources, _dest = [w for w in line.split()[1:] if not w.startswith("--")]
            for src in sources:
                assert (REPO / src).exists(), src
    assert "python -m router.proto" in text and "pip install" in text

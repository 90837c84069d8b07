"""Pools sharing GPUs (`gpus_per_rank` below 1): what Ray is asked for, and that a replica's ranks still
land on distinct GPUs. Ray's GPUs here are logical (a CPU machine started with num_gpus=2), which is all
placement and Ray's GPU-id assignment look at."""
from __future__ import annotations

import pytest
import ray

from cluster.placement import RankPlacement
from parallel.config import ParallelConfig
from workers.executor import ExecutorError


def test_several_ranks_need_more_than_half_a_gpu_each():
    with pytest.raises(ValueError, match="gpus_per_rank=0.5 with 2 ranks"):
        ParallelConfig(sequence_parallel_size=2, gpus_per_rank=0.5)
    assert ParallelConfig(sequence_parallel_size=2, gpus_per_rank=0.75).gpus_per_rank == 0.75
    assert ParallelConfig(gpus_per_rank=0.25).gpus_per_rank == 0.25  # one rank may take any share
    with pytest.raises(ValueError):
        ParallelConfig(gpus_per_rank=0.0)
    with pytest.raises(ValueError):
        ParallelConfig(gpus_per_rank=1.5)


def test_an_in_process_decode_replica_takes_its_share_of_a_gpu():
    from router.colocated import in_process_rank_options
    from router.config import AppConfig

    config = AppConfig(model="models/tandem-tiny", device="cuda",
                       decode={"num_replicas": 1, "gpus_per_rank": 0.25})
    assert in_process_rank_options(config, "decode") == {"num_gpus": 0.25, "resources": {}}
    assert in_process_rank_options(config.model_copy(update={"device": "cpu"}), "decode")["num_gpus"] == 0


@pytest.fixture(scope="module")
def two_logical_gpus():
    ray.shutdown()
    ray.init(num_cpus=2, num_gpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class _GpuProbe:
    def gpu_ids(self) -> list:
        return [str(i) for i in ray.get_gpu_ids()]


def _probe(placement: RankPlacement, rank: int, gpus: float) -> list[str]:
    actor = _GpuProbe.options(num_gpus=gpus, scheduling_strategy=placement.strategy(rank)).remote()
    try:
        return ray.get(actor.gpu_ids.remote(), timeout=30)
    finally:
        ray.kill(actor)


def test_an_sp2_prefill_pool_and_a_decode_rank_share_two_gpus(two_logical_gpus):
    """The served layout of issue 28 on a two-GPU host: SP=2 prefill ranks at 0.75, a decode rank at 0.25."""
    prefill = RankPlacement(ParallelConfig(sequence_parallel_size=2, gpus_per_rank=0.75), use_cuda=True, timeout_s=30)
    decode = RankPlacement(ParallelConfig(gpus_per_rank=0.25), use_cuda=True, timeout_s=30)
    try:
        assert prefill.bundle == {"GPU": 0.75} and decode.bundle == {"GPU": 0.25}
        ranks = [_probe(prefill, r, 0.75) for r in range(2)]
        assert sorted(ranks) == [["0"], ["1"]]  # one GPU each: 0.75 + 0.75 cannot pack onto one
        assert _probe(decode, 0, 0.25)[0] in ("0", "1")
        # Nothing is left for a third whole-GPU rank: waiting for it ends in a clear error, not a hang.
        with pytest.raises(ExecutorError, match=r"could not place 1 ranks \(1 groups of 1 GPUs"):
            RankPlacement(ParallelConfig(), use_cuda=True, timeout_s=2)
    finally:
        prefill.remove()
        decode.remove()


def test_more_gpus_than_the_cluster_has_fail_at_once(two_logical_gpus):
    with pytest.raises(ExecutorError, match=r"3 ranks need 3 GPUs"):
        RankPlacement(ParallelConfig(tensor_parallel_size=3), use_cuda=True, timeout_s=600)
    # At 0.75 each, three ranks need 2.25 GPUs, and a TP group of three must sit on one node.
    with pytest.raises(ExecutorError, match=r"need 2.25 GPUs"):
        RankPlacement(ParallelConfig(tensor_parallel_size=3, gpus_per_rank=0.75), use_cuda=True, timeout_s=600)


def test_an_app_that_needs_more_gpus_than_the_cluster_fails_at_start_with_the_breakdown():
    """Found on two GPUs: an SP=2 prefill pool and a decode pool at one GPU per rank need three, and the app
    waited for the third without a word. `tandem serve` now says so before deploying."""
    from router.config import AppConfig
    from tandem.serving import check_gpus_suffice

    def app(**kw) -> AppConfig:
        return AppConfig(**{"model": "models/tandem-tiny", "device": "cuda", **kw})

    sp2 = app(prefill={"sequence_parallel_size": 2})
    assert sp2.gpus_needed() == {"prefill": 2, "decode": 1}
    with pytest.raises(ValueError, match=r"needs 3 GPUs .*prefill 2, decode 1.* has 2; .*gpus_per_rank"):
        check_gpus_suffice(sp2, 2, own_cluster=True)
    assert "waiting for the cluster to grow" in check_gpus_suffice(sp2, 2, own_cluster=False)  # an autoscaler may add some
    shared = app(prefill={"sequence_parallel_size": 2, "gpus_per_rank": 0.75}, decode={"gpus_per_rank": 0.25})
    assert shared.gpus_needed() == {"prefill": 1.5, "decode": 0.25}
    assert check_gpus_suffice(shared, 2, own_cluster=True) is None
    replicas = app(colocated=True, tensor_parallel_size=2, decode={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4,
                                                                                          "initial_replicas": 2}})
    assert replicas.gpus_needed() == {"colocated": 4}
    assert check_gpus_suffice(app(device="cpu", prefill={"sequence_parallel_size": 2}), 0, own_cluster=True) is None
    assert check_gpus_suffice(app(device="auto"), 0, own_cluster=True) is None  # auto on a GPU-less cluster: CPU


def test_the_router_gets_replicas_per_decode_replica_on_gpus_one_on_cpus_or_what_is_given():
    """One router process saturated at ~7 req/s on 2 x H100 while its decode replica idled half its GPU
    (docs/benchmarks.md, "Ninth session"): with GPUs, the disaggregated app starts several, in step with the decode pool."""
    from router.config import ROUTERS_PER_GPU_DECODE_REPLICA as K, AppConfig
    from router.disaggregated import build_disaggregated_app

    def app(**kw) -> AppConfig:
        return AppConfig(**{"model": "models/tandem-tiny", "device": "cuda", **kw})

    assert app().router_serve_options(on_gpus=True) == {"num_replicas": K}
    assert app(decode={"num_replicas": 3}).router_serve_options(on_gpus=True) == {"num_replicas": 3 * K}
    # An autoscaled decode pool: the router autoscales on K times its bounds, with its per-replica target split K ways;
    # Serve's defaults fill what the config leaves out, and the router never scales to zero.
    scaled = app(decode={"autoscaling_config": {"min_replicas": 0, "max_replicas": 8, "initial_replicas": 2,
                                                "target_ongoing_requests": 128, "upscale_delay_s": 30}})
    auto = scaled.router_serve_options(on_gpus=True)["autoscaling_config"]
    assert auto == {"min_replicas": 1, "max_replicas": 8 * K, "initial_replicas": 2 * K,
                    "target_ongoing_requests": 128 / K, "upscale_delay_s": 30}
    bare = app(decode={"autoscaling_config": {"max_replicas": 2}}).router_serve_options(on_gpus=True)["autoscaling_config"]
    assert bare["min_replicas"] == K and bare["max_replicas"] == 2 * K and "initial_replicas" not in bare
    assert app(device="cpu").router_serve_options(on_gpus=False) == {"num_replicas": 1}
    assert scaled.router_serve_options(on_gpus=False) == {"num_replicas": 1}
    assert app(router_replicas=3).router_serve_options(on_gpus=True) == {"num_replicas": 3}
    with pytest.raises(ValueError, match="router_replicas"):
        app(colocated=True, router_replicas=2)
    with pytest.raises(ValueError):
        app(router_replicas=0)
    # The built app: its ingress deployment (the router) has that many replicas; GPU-less here, so one.
    assert build_disaggregated_app(app(device="cpu"))._bound_deployment.num_replicas == 1
    assert build_disaggregated_app(app(device="cpu", router_replicas=2))._bound_deployment.num_replicas == 2
    on_gpus = build_disaggregated_app(app(decode={"autoscaling_config": {"min_replicas": 1, "max_replicas": 4}}))
    router_auto = on_gpus._bound_deployment._deployment_config.autoscaling_config
    assert (router_auto.min_replicas, router_auto.max_replicas) == (K, 4 * K)


def test_the_decode_stream_pace_defaults_by_device_and_reaches_the_replicas():
    """`stream_items_per_s` unset: 1,000 items a second with GPUs, 250 on CPUs (router/config.py says why), resolved
    when the app is built so every deployment gets the same value; a given value, 0 included, wins."""
    from router.config import STREAM_ITEMS_PER_S_CPU, STREAM_ITEMS_PER_S_GPU, AppConfig
    from router.disaggregated import build_disaggregated_app

    def app(**kw) -> AppConfig:
        return AppConfig(**{"model": "models/tandem-tiny", **kw})

    assert app().resolved_stream_items_per_s(on_gpus=True) == STREAM_ITEMS_PER_S_GPU == 1000.0
    assert app().resolved_stream_items_per_s(on_gpus=False) == STREAM_ITEMS_PER_S_CPU == 250.0
    assert app(stream_items_per_s=0).resolved_stream_items_per_s(on_gpus=True) == 0
    assert app(stream_items_per_s=40).resolved_stream_items_per_s(on_gpus=False) == 40
    with pytest.raises(ValueError):
        app(stream_items_per_s=-1)
    # The built app hands the resolved value to its deployments (the Router's args; the pools get the same dict).
    assert build_disaggregated_app(app(device="cpu"))._bound_deployment.init_args[0]["stream_items_per_s"] == 250.0
    assert build_disaggregated_app(app(device="cpu", stream_items_per_s=0))._bound_deployment.init_args[0]["stream_items_per_s"] == 0
    assert build_disaggregated_app(app(device="cuda"))._bound_deployment.init_args[0]["stream_items_per_s"] == 1000.0

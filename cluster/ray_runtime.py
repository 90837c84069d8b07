"""Starting (or joining) Ray, and the environment every rank process gets."""
from __future__ import annotations

import logging
import os
import secrets

import ray

# The rank processes must import this repository's packages wherever Ray starts them.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# NVLink multicast (NVLS) and symmetric-memory multicast hang or fail on some hosts; the ranks only
# need plain NCCL collectives and p2p. A value already set in the driver's environment wins.
_NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
# Settings the rank processes read: diagnostics (workers/rank_profile.py: per-step chrome traces, and the served
# ranks' own step profile, logged as they run; workers/kv_transfer/transport.py: each handoff's phases), the KV
# handoff's knobs (transport.py: NCCL stream priority, row-copy grid caps) and the quantized paths' knobs
# read at load (measured FP8 GEMV tiles, the fused quantized GEMV and its 4-bit opt-in, FP8 activations from their
# producers, fast FP8 accumulation, tinygemm's inner_k_tiles, the 4-bit kernel choices (Triton or tinygemm; w4_mma at
# 1-8 rows), load-time tuning: parallel/kernels/gemv_quant.py, parallel/quant/fused_gemv.py, fp8_act.py, packed.py,
# tinygemm.py; tests/test_quant_env_forwarded.py).
_FORWARDED_ENV = ("TANDEM_PROFILE_TRACE_DIR", "TANDEM_RANK_PROFILE", "TANDEM_KV_PHASES", "TANDEM_KV_NCCL_HIGH_PRIORITY",
                  "TANDEM_KV_OVERLAP_COPY_PROGRAMS", "TANDEM_KV_COPY_PROGRAMS", "TANDEM_KV_LEAN", "TANDEM_KV_PAIR_GROUPS", "TANDEM_KV_PEER_IPC",
                  "TANDEM_FP8_TABLE", "TANDEM_FUSED_QUANT", "TANDEM_FP8_FUSED_ACT", "TANDEM_FP8_FAST_ACCUM",
                  "TANDEM_FUSED_INT4", "TANDEM_TINYGEMM_IKT", "TANDEM_W4_GEMV", "TANDEM_W4A16_KERNEL",
                  "TANDEM_QUANT_TUNE", "TANDEM_TP_OWN_FILL", "TANDEM_TP_PUSH_PARTIALS", "TANDEM_ATTN_REPEAT",
                  "TANDEM_GC_FREEZE", "TANDEM_RANK_LAUNCH_AHEAD", "TANDEM_LAUNCH_MIXED", "TANDEM_RING_KERNEL", "TANDEM_RING_HBAND_L2",
                  "TANDEM_TP_GREEDY_KERNELS", "TANDEM_TP_EMBED", "TANDEM_TP_TAKE_WAIT",
                  "TANDEM_GEMV_TAKE_TILE", "TANDEM_TP_ROW_REDUCE", "TANDEM_P2P_PUSHED", "TANDEM_P2P_TWO_SHOT",
                  "TANDEM_GEMV_TAKE_X", "TANDEM_TP_GREEDY_GATHER")
# Where a user or operator may have given Ray a token already: theirs wins.
AUTH_TOKEN_SOURCES = ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH")


def use_private_ray_token(environ: dict[str, str] | None = None) -> bool:
    """Give the private local Ray this process is about to start a token of its own, in RAY_AUTH_TOKEN.

    Why: Ray 2.60's `ray.init()` of a new local cluster turns token authentication on and, finding no
    token, writes one to ~/.ray/auth_token. Every later `ray start` of this user then enables token
    auth because that file exists, while `serve deploy` (RAY_AUTH_MODE unset) sends no token and fails
    with "Missing authentication token". With the token in the environment (inherited by the GCS,
    raylet and every worker this process starts, seen by no one else) the private instance is still
    protected and nothing is left behind. A token or mode already set wins: True only if one was set here.

    Any RAY_AUTH_MODE counts as set: Ray itself sets it in this process at its first local start, and
    caches the token it used then; a new token in the environment after that would make the next
    local start's GCS and this process's client disagree ("Failed to start GCS ... InvalidAuthToken").
    """
    environ = os.environ if environ is None else environ
    if environ.get("RAY_AUTH_MODE") or any(environ.get(k) for k in AUTH_TOKEN_SOURCES):
        return False
    environ["RAY_AUTH_TOKEN"] = secrets.token_hex(32)
    return True


def ensure_ray(num_cpus: int) -> None:
    """Use the Ray this process is already connected to; else join $RAY_ADDRESS; else start a
    private local instance with at least `num_cpus` CPUs (no dashboard).

    A private instance (address="local") is deliberate: `ray.init()` alone would attach to any
    cluster someone else started on this machine.
    """
    if ray.is_initialized():
        return
    if os.environ.get("RAY_ADDRESS"):
        ray.init(logging_level=logging.WARNING)
        return
    use_private_ray_token()  # leave no ~/.ray/auth_token behind (see above)
    ray.init(address="local", num_cpus=max(num_cpus, os.cpu_count() or 1), include_dashboard=False,
             logging_level=logging.WARNING)


# Set in a rank's environment where it must see every GPU of its node, not only its own: the P2P all-reduce
# (parallel/p2p_allreduce.py) maps peers' buffers, and torch's symmetric memory refuses two ranks that
# both call their GPU cuda:0. Ray then leaves CUDA_VISIBLE_DEVICES alone and the rank picks its GPU itself.
RANK_SEES_NODE_GPUS = "TANDEM_RANK_SEES_NODE_GPUS"


def rank_runtime_env(see_node_gpus: bool = False) -> dict:
    """The rank actors' environment; `see_node_gpus`: every GPU of the node visible (cluster/rank_worker.py)."""
    pythonpath = os.pathsep.join(p for p in (REPO_ROOT, os.environ.get("PYTHONPATH", "")) if p)
    env = {k: os.environ.get(k, v) for k, v in _NCCL_ENV.items()}
    if see_node_gpus:
        env[RANK_SEES_NODE_GPUS] = "1"
        env["RAY_EXPERIMENTAL_NOSET_CUDA_VISIBLE_DEVICES"] = "1"
    env["PYTHONPATH"] = pythonpath
    for k in _FORWARDED_ENV:  # set in the driver only for a diagnosis: the ranks must see it too
        if os.environ.get(k):
            env[k] = os.environ[k]
    return {"env_vars": env}

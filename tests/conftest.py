import logging
import os
import sys

import pytest

# Lets the tests import the packages without `pip install -e .`.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

# ---------------------------------------------------------------- one local Ray for the session
#
# Starting a local Ray (`ray.init(address="local")`) takes 10-14 s on CI's 2 cores, and about twenty
# modules need one. `shared_ray` starts it once, with logical CPUs enough for every module's largest
# layout (Ray's CPUs are a count, not cores), and leaves it running for the next module. Each module
# still starts and shuts down its own Serve instance and engines. A module that needs a Ray of its own
# (other resources, or no other module's actors around) shuts this one down first (`no_shared_ray`, or
# its own `ray.shutdown()`); the next module that asks for `shared_ray` then starts a new one.
# 6: the largest layout (tests/test_disagg_sp.py, 4 prefill + 2 decode ranks), and fewer than the 8 ranks that
# tests/test_multirank_llm.py (and sp64 in tests/test_bench_sp_prefill.py) expect not to fit.
SHARED_RAY_CPUS = 6
_shared: dict = {}


def _shared_ray_is_connected() -> bool:
    import ray

    return (ray.is_initialized() and bool(_shared.get("gcs"))
            and ray.get_runtime_context().gcs_address == _shared["gcs"])


def start_shared_ray() -> str:
    """The session's local Ray (started if this process is not connected to it); its address."""
    import ray

    if _shared_ray_is_connected():
        return _shared["address"]
    if ray.is_initialized():
        ray.shutdown()  # a Ray some other code started (e.g. LLM(...) for its ranks) and left running
    with pytest.MonkeyPatch.context() as mp:
        # Ray's workers (rank actors, Serve replicas) inherit the raylet's environment: let them import this repo.
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (REPO, os.environ.get("PYTHONPATH")) if p))
        context = ray.init(address="local", num_cpus=SHARED_RAY_CPUS, include_dashboard=False,
                           logging_level=logging.WARNING)
    _shared.update(gcs=context.address_info["gcs_address"], address=context.address_info["address"])
    return _shared["address"]


def stop_ray() -> None:
    """Shut down whatever Ray this process is connected to (the shared one included)."""
    import ray

    if ray.is_initialized():
        ray.shutdown()
    _shared.clear()


@pytest.fixture(scope="module")
def shared_ray() -> str:
    """The session's local Ray with SHARED_RAY_CPUS CPUs (see above): its address. Not shut down at the
    end of the module; a module must remove what it created in it (engines, Serve)."""
    return start_shared_ray()


@pytest.fixture(scope="module")
def no_shared_ray():
    """For a module whose code starts (and stops) a private Ray of its own in this process."""
    stop_ray()
    yield
    stop_ray()


def pytest_collection_finish(session) -> None:
    """Run the selected `@pytest.mark.interpreted(SCRIPT, timeout=...)` tests' scripts ahead, on the CPU the
    other tests leave idle (tests/interpreter.py)."""
    from tests.interpreter import run_ahead

    run_ahead([(m.args[0], m.kwargs.get("timeout", 900)) for item in session.items
               for m in item.iter_markers("interpreted")])


def pytest_sessionfinish(session, exitstatus):
    from tests.interpreter import stop_run_ahead

    stop_run_ahead()
    if _shared:
        stop_ray()

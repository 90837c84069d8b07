"""GPU-only tests: every test here is skipped without CUDA (and Triton), so CPU CI collects them cleanly."""
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    reason = None
    if not torch.cuda.is_available():
        reason = "needs a CUDA GPU"
    else:
        try:
            import triton  # noqa: F401
        except ImportError:
            reason = "needs Triton"
    if reason:
        marker = pytest.mark.skip(reason=reason)
        for item in items:
            if "tests/gpu" in str(item.fspath).replace("\\", "/"):
                item.add_marker(marker)

"""Launch a kernel compiled by NVRTC (`torch.cuda._compile_kernel`) with programmatic dependent launch (PDL).

torch's launcher calls `cuLaunchKernel`, which takes no launch attributes. Under CUDA-graph capture on Hopper a
kernel launched through `cuLaunchKernelEx` with CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION may start
before the kernel ahead of it in the stream has finished: it runs until its `griddepcontrol.wait`, which returns once
that kernel has completed and its writes are visible (the kernel ahead may let it start earlier still with
`griddepcontrol.launch_dependents`). A batch-1 decoder layer is a chain of short kernels, so each one's first weight
loads then overlap the tail of the one before (the Triton kernels of that chain take `launch_pdl=True`, gemv.py).
A kernel launched this way must wait before it touches anything an earlier kernel writes or reads.
"""
from __future__ import annotations

import ctypes
import os

import torch

_PROGRAMMATIC_STREAM_SERIALIZATION = 6  # CUlaunchAttributeID


class _LaunchAttribute(ctypes.Structure):  # CUlaunchAttribute: the id, padding to 8 bytes, a 64-byte value union
    _fields_ = [("id", ctypes.c_int), ("pad", ctypes.c_char * 4), ("value", ctypes.c_char * 64)]


class _LaunchConfig(ctypes.Structure):  # CUlaunchConfig
    _fields_ = [("grid_x", ctypes.c_uint), ("grid_y", ctypes.c_uint), ("grid_z", ctypes.c_uint),
                ("block_x", ctypes.c_uint), ("block_y", ctypes.c_uint), ("block_z", ctypes.c_uint),
                ("shared_mem", ctypes.c_uint), ("stream", ctypes.c_void_p),
                ("attrs", ctypes.POINTER(_LaunchAttribute)), ("num_attrs", ctypes.c_uint)]


_LIBCUDA: ctypes.CDLL | None = None


def _libcuda() -> ctypes.CDLL:
    global _LIBCUDA
    if _LIBCUDA is None:
        _LIBCUDA = ctypes.CDLL("libcuda.so.1")
        _LIBCUDA.cuLaunchKernelEx.argtypes = [ctypes.POINTER(_LaunchConfig), ctypes.c_void_p,
                                              ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p]
        _LIBCUDA.cuLaunchKernelEx.restype = ctypes.c_int
    return _LIBCUDA


_SM_COUNT: dict[int, int] = {}


def sm_count(device: torch.device) -> int:
    """The device's streaming multiprocessors (132 for a CPU device: an H100 / H200's count, for launch shapes)."""
    if device.type != "cuda":
        return 132
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


_PDL: bool | None = None


def pdl_supported() -> bool:
    """Programmatic dependent launch: Hopper or newer, and not turned off with TANDEM_PDL=0 (read once; gemv.py's
    Triton kernels follow the same switch, scripts/bench_latency.py compares both)."""
    global _PDL
    if _PDL is None:
        _PDL = os.environ.get("TANDEM_PDL", "1") != "0" and torch.cuda.get_device_capability()[0] >= 9
    return _PDL


def pdl_wanted(x: torch.Tensor) -> bool:
    """Whether a launch on x's device goes PDL: under CUDA-graph capture where `pdl_supported`."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing() and pdl_supported()


def kernel_args(args: list) -> tuple[ctypes.Array, list]:
    """The kernel parameter array for tensors (their device pointers) and Python ints (C int), as torch's launcher
    builds it, and the ctypes objects it points at (keep them alive until the launch returns)."""
    held = []
    for arg in args:
        if isinstance(arg, torch.Tensor):
            held.append(ctypes.c_void_p(arg.data_ptr()))
        elif isinstance(arg, int):
            held.append(ctypes.c_int(arg))
        else:
            raise TypeError(f"kernel argument of type {type(arg).__name__} (tensors and ints only)")
    array = (ctypes.c_void_p * len(held))(*[ctypes.cast(ctypes.byref(h), ctypes.c_void_p) for h in held])
    return array, held


def launch_pdl(kernel, grid: tuple[int, int, int], block: tuple[int, int, int], args: list, shared_mem: int = 0) -> None:
    """`kernel(grid=..., block=..., args=..., shared_mem=...)` on the current stream, with PDL."""
    attr = _LaunchAttribute(id=_PROGRAMMATIC_STREAM_SERIALIZATION)
    attr.value = (1).to_bytes(4, "little")  # programmaticStreamSerializationAllowed = 1
    config = _LaunchConfig(*grid, *block, shared_mem, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream),
                           ctypes.pointer(attr), 1)
    array, held = kernel_args(args)
    err = _libcuda().cuLaunchKernelEx(ctypes.byref(config), kernel.func, array, None)
    if err != 0:
        raise RuntimeError(f"cuLaunchKernelEx failed with CUDA error {err}")
    del held

"""parallel/kernels/cuda_launch.py's ctypes mirror of the driver's launch structs, checked without a GPU: a wrong
size or offset would hand cuLaunchKernelEx garbage (CUDA's cuda.h: CUlaunchAttribute is a 4-byte id, padding to 8, a
64-byte value union; CUlaunchConfig is 7 unsigned ints, the stream, the attribute pointer and their count)."""
from __future__ import annotations

import ctypes

import pytest
import torch

from parallel.kernels.cuda_launch import _LaunchAttribute, _LaunchConfig, kernel_args, sm_count


def test_launch_structs_match_the_driver_layout() -> None:
    assert ctypes.sizeof(_LaunchAttribute) == 72 and _LaunchAttribute.value.offset == 8
    assert ctypes.sizeof(_LaunchConfig) == 56
    assert (_LaunchConfig.shared_mem.offset, _LaunchConfig.stream.offset, _LaunchConfig.attrs.offset,
            _LaunchConfig.num_attrs.offset) == (24, 32, 40, 48)


def test_kernel_args_point_at_tensors_and_ints() -> None:
    t = torch.zeros(4)
    array, held = kernel_args([t, 7])
    assert len(array) == 2
    assert ctypes.c_void_p.from_address(array[0]).value == t.data_ptr()
    assert ctypes.c_int.from_address(array[1]).value == 7
    with pytest.raises(TypeError, match="float"):
        kernel_args([1.5])
    assert sm_count(torch.device("cpu")) == 132

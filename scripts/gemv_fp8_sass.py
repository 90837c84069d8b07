#!/usr/bin/env python3
"""Compile the FP8 batch-1 GEMV (parallel/kernels/gemv_quant.py) for sm_90 without a GPU and count what it became.

For each tile: registers a thread, stack (spills), and in the K loop's body (the longest backward branch) the
instructions, barriers (BAR: a shared-memory exchange every step) and global loads; plus the whole kernel's most
frequent opcodes. This is where gemv_quant's comments on register counts and barriers come from; GPU timings are
`scripts/bench_gemv.py --fp8 --sweep`'s.

    python scripts/gemv_fp8_sass.py --kind residual --k 14336 --tiles 4,128,4,8 8,16,2,64
    python scripts/gemv_fp8_sass.py --kind paired --k 4096 --tiles 2,128,4,8 8,32,4,16
A tile is BLOCK_N,KS,num_warps,BLOCK_C[,1] (BLOCK_C 64: the 64-byte chunks; 8 or 16: the RED tiles; a fifth
field 1: PREFETCH). Needs Triton's
bundled ptxas and cuobjdump (triton/backends/nvidia/bin), no GPU.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

PTRS = dict(x_ptr="*bf16", w_ptr="*fp8e4nv", s_ptr="*fp32", z_ptr="*fp32", b_ptr="*fp32", y_ptr="*bf16",
            nw_ptr="*bf16", r_ptr="*bf16", pos_ptr="*i32", cs_ptr="*fp32", perm_ptr="*i32")


def compile_tile(tile: tuple[int, ...], kind: str, k: int):
    """The kernel as qgemv launches it for an FP8 per-channel weight under CUDA-graph capture (PDL on), compiled."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from parallel.kernels import gemv_quant as gq

    bn, ks, warps, chunk = tile[:4]
    prefetch = len(tile) > 4 and bool(tile[4])
    paired = kind == "paired"
    consts = dict(FMT=gq.FP8, BITS=8, GS=k, J=1, BLOCK_N=bn, KS=ks, BLOCK_C=chunk, HAS_ZERO=False, HAS_BIAS=False,
                  EVEN_N=True, NORM=paired, K_PAD=triton.next_power_of_2(k) if paired else 1, SILU=paired,
                  RESIDUAL=kind == "residual", ROPE=False, HEAD_DIM=2, ROT_ROWS=0, PAIRED=paired, PERM=False,
                  SCALE_END=True, RED=chunk != 64, PREFETCH=prefetch, USE_PDL=True, INTERPRETED=False)
    fn = gq._qgemv_kernel.fn
    names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    sig = {n: PTRS.get(n) or ("constexpr" if n in consts else "fp32" if n == "eps" else "i32") for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names if n in PTRS or n in ("K", "stride_w", "N")}
    src = ASTSource(fn=gq._qgemv_kernel, signature=sig, attrs=aligned,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=1))


def _cuobjdump(*args: str) -> str:
    import triton

    tool = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(tool), *args], capture_output=True, text=True, check=True).stdout


def sass_ops(cubin: bytes) -> tuple[str, list[str], list[str]]:
    """A compiled kernel's resource usage (cuobjdump's text), every instruction's opcode, and the K loop's opcodes (the
    body of the longest backward branch)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        res, sass = _cuobjdump("-res-usage", f.name), _cuobjdump("-sass", f.name)
    finally:
        os.unlink(f.name)
    lines = [ln for ln in sass.splitlines() if re.match(r"\s+/\*[0-9a-f]{4}\*/", ln)]
    addr = [int(re.search(r"/\*([0-9a-f]{4})\*/", ln).group(1), 16) for ln in lines]
    ops = [re.sub(r"^\s+/\*[0-9a-f]+\*/\s+(@!?U?P\w+\s+)?", "", ln).split()[0].rstrip(";") for ln in lines]
    loop = (0, -1)
    for i, ln in enumerate(lines):  # the longest backward branch: the K loop
        m = re.search(r"BRA (?:!?P\d, )?0x([0-9a-f]+)", ln)
        if m and int(m.group(1), 16) < addr[i] and int(m.group(1), 16) in addr:
            j = addr.index(int(m.group(1), 16))
            if i - j > loop[1] - loop[0]:
                loop = (j, i)
    return res, ops, ops[loop[0]:loop[1] + 1]


def stats(cubin: bytes) -> dict:
    """Registers, stack, and the K loop's instruction mix of a compiled kernel."""
    res, ops, body = sass_ops(cubin)
    return {"registers": int(re.search(r"REG:(\d+)", res).group(1)), "stack": int(re.search(r"STACK:(\d+)", res).group(1)),
            "loop_instructions": len(body), "loop_barriers": sum(o.startswith("BAR") for o in body),
            "loop_loads": [o for o in body if o.startswith("LDG")],
            "top": collections.Counter(o.split(".")[0] for o in ops).most_common(8)}


def main(argv: list[str] | None = None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kind", choices=("residual", "paired", "plain"), default="residual")
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--tiles", nargs="+", default=["4,128,4,8", "8,16,2,64"], help="BLOCK_N,KS,num_warps,BLOCK_C")
    a = p.parse_args(argv)
    out = []
    for spec in a.tiles:
        tile = tuple(int(v) for v in spec.split(","))
        row = {"tile": spec, "kind": a.kind, "k": a.k, **stats(compile_tile(tile, a.kind, a.k).asm["cubin"])}
        print(row, flush=True)
        out.append(row)
    return out


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Compile the batch-1 W4A16 GEMV (parallel/kernels/gemv_w4.py) for sm_90 without a GPU and count what it became.

Per tile: registers a thread, stack (spills), shared memory, and over the whole kernel the instructions per 4-bit code
of one program's step (the loop body when there is a loop), its global loads by width and its barriers (a BAR in the
body: a layout exchange through shared memory every step). GPU timings are scripts/bench_gemv_w4.py's.

    python scripts/gemv_w4_sass.py --k 4096 --tiles 8,128,4 8,32,1,2
A tile is BLOCK_N,C,num_warps[,PREFETCH (steps prefetched by hand: 1 default, 2; 0: Triton's loop)[,NUM_STAGES
[,SPLIT_K[,MAXNREG]]]]. Needs Triton's
bundled ptxas and cuobjdump (triton/backends/nvidia/bin), no GPU.
"""
from __future__ import annotations

import argparse
import collections
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from scripts.gemv_fp8_sass import sass_ops  # noqa: E402

PTRS = dict(x32_ptr="*i32", w_ptr="*i32", sz_ptr="*i32", y_ptr="*bf16", yf_ptr="*fp32")


def compile_tile(tile: tuple[int, ...], k: int, even: bool = True):
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from parallel.kernels import gemv_w4 as w4

    bn, c, warps = tile[:3]
    prefetch = tile[3] if len(tile) > 3 else 1
    stages = tile[4] if len(tile) > 4 else 1
    split = tile[5] if len(tile) > 5 else 1
    maxnreg = tile[6] if len(tile) > 6 else None
    consts = dict(BLOCK_N=bn, C=c, EVEN=even, PREFETCH=prefetch, NUM_STAGES=stages, SPLIT_K=split, MEMONLY=False)
    fn = w4._w4_kernel.fn
    names = list(fn.__code__.co_varnames[:fn.__code__.co_argcount])
    sig = {n: PTRS.get(n) or ("constexpr" if n in consts else "i32") for n in names}
    aligned = {(names.index(n),): [["tt.divisibility", 16]] for n in names
               if n in PTRS or n in ("N", "NCH", "BSTRIDE", "NS", "EXPR")}
    src = ASTSource(fn=w4._w4_kernel, signature=sig, attrs=aligned,
                    constexprs={(names.index(n),): v for n, v in consts.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=dict(num_warps=warps, num_stages=stages,
                                                                                **({"maxnreg": maxnreg} if maxnreg else {})))


def stats(kernel, tile: tuple[int, ...]) -> dict:
    res, ops, body = sass_ops(kernel.asm["cubin"])
    bn, c, warps = tile[:3]
    codes = bn * c * 32  # one step of one program
    return {"tile": tile, "registers": int(re.search(r"REG:(\d+)", res).group(1)),
            "stack": int(re.search(r"STACK:(\d+)", res).group(1)), "shared": kernel.metadata.shared,
            "instructions": len(ops), "per_code_x_threads": round(len(ops) * 32 * warps / codes, 2),
            "barriers": sum(o.startswith("BAR") for o in ops), "loop_instructions": len(body),
            "loop_per_code_x_threads": round(len(body) * 32 * warps / codes, 2),
            "loop_barriers": sum(o.startswith("BAR") for o in body),
            "loads": dict(collections.Counter(o for o in ops if o.startswith(("LDG", "LDS", "LDGSTS")))),
            "top": collections.Counter(o.split(".")[0] for o in ops).most_common(10)}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--k", type=int, default=4096)
    p.add_argument("--tiles", nargs="+", default=["8,128,4"])
    p.add_argument("--ttgir", action="store_true", help="print the TTGIR of each tile too")
    a = p.parse_args(argv)
    for spec in a.tiles:
        tile = tuple(int(v) for v in spec.split(","))
        kern = compile_tile(tile, a.k)
        if a.ttgir:
            print(kern.asm["ttgir"])
        print(stats(kern, tile), flush=True)


if __name__ == "__main__":
    main()

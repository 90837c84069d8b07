#!/usr/bin/env python3
"""The KV handoff's gather and scatter alone, on one device: the blocks of a prompt (scattered over a cache
twice its size) copied into one contiguous buffer and back, as `workers/kv_transfer/blocks.py` does it
(8-byte words) beside an element-wise `index_select` / `index_copy_` in the cache's own dtype (the way
before 2026-11-26), same run. Llama-3.1-8B KV shapes, bf16.

    python scripts/bench_kv_gather.py --device cuda [--tokens 1024,8192,32768] [--copy-programs 32,64]
        [--out bench_results/kv_gather.json]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel.kernels.quant_tiles import cuda_time  # noqa: E402
from workers.kv_transfer.blocks import block_index, gather_blocks, scatter_blocks  # noqa: E402

LAYERS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16


def timed_ms(fn, device: torch.device, iters: int = 10) -> float:
    if device.type == "cuda":
        return cuda_time(fn, iters)
    fn()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - t0) / iters * 1e3


def row(tokens: int, device: torch.device, caps: list[int]) -> dict:
    num_blocks = -(-tokens // BLOCK)
    cache = torch.randn(LAYERS, 2, 2 * num_blocks, BLOCK, KV_HEADS, HEAD_DIM, device=device).to(torch.bfloat16)
    ids = torch.randperm(2 * num_blocks, generator=torch.Generator().manual_seed(0))[:num_blocks].tolist()
    index, every = block_index(ids, device), slice(None)
    buf = gather_blocks(cache, ids, every, every, index)
    if not torch.equal(buf, cache.index_select(2, index)):
        raise AssertionError("gather_blocks differs from index_select")
    out = {"tokens": tokens, "bytes": buf.numel() * buf.element_size()}
    for name, fn in (("gather_elementwise_ms", lambda: cache.index_select(2, index).contiguous()),
                     ("gather_ms", lambda: gather_blocks(cache, ids, every, every, index)),
                     ("scatter_elementwise_ms", lambda: cache.index_copy_(2, index, buf)),
                     ("scatter_ms", lambda: scatter_blocks(cache, ids, every, every, buf, index))):
        out[name] = timed_ms(fn, device)
    for cap in caps if device.type == "cuda" else []:  # the row copy with its grid capped (CPU has no row copy)
        from parallel.kernels import block_copy

        block_copy.MAX_PROGRAMS = cap
        out[f"gather_c{cap}_ms"] = timed_ms(lambda: gather_blocks(cache, ids, every, every, index), device)
        out[f"scatter_c{cap}_ms"] = timed_ms(lambda: scatter_blocks(cache, ids, every, every, buf, index), device)
        block_copy.MAX_PROGRAMS = 0
    out["gather_traffic_tb_s"] = 2 * out["bytes"] / out["gather_ms"] / 1e9  # read + write
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--tokens", default="1024,8192,32768")
    p.add_argument("--copy-programs", default="", help="comma-separated grid caps of the row copy to time too (GPU)")
    p.add_argument("--out", default="bench_results/kv_gather.json")
    a = p.parse_args()
    caps = [int(c) for c in a.copy_programs.split(",") if c]
    device = torch.device(a.device)
    rows = []
    print(f"{'tokens':>7} {'MiB':>7} {'gather ms':>10} {'(elementwise)':>13} {'scatter ms':>11} {'(elementwise)':>13} {'TB/s':>6}")
    for tokens in (int(t) for t in a.tokens.split(",")):
        r = row(tokens, device, caps)
        rows.append(r)
        print(f"{tokens:>7} {r['bytes'] / 2**20:>7.1f} {r['gather_ms']:>10.3f} {r['gather_elementwise_ms']:>13.3f} "
              f"{r['scatter_ms']:>11.3f} {r['scatter_elementwise_ms']:>13.3f} {r['gather_traffic_tb_s']:>6.2f}  "
              + " ".join(f"{k}={v:.3f}" for k, v in r.items() if "_c" in k), flush=True)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"benchmark": "kv_gather", "date": time.strftime("%Y-%m-%d"), "device": name, "rows": rows}, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()

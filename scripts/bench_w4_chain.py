#!/usr/bin/env python3
"""The batch-1 fused decoder's layer chain on its own: per layer the four fused GEMVs of a Llama-3.1-8B decoder
layer (qkv with RMSNorm and RoPE, o with the residual add, gate_up with RMSNorm and SiLU, down with the residual
add) and the decode attention between qkv and o, `--layers` layers replayed from one CUDA graph with programmatic
dependent launch between the kernels, as `workers/models/fused_decode.py` runs them in a decode step. 4-bit weights
in tinygemm's layout (group 128) on `w4_mma.gemv_w4_mma_fused`, beside the same chain on bf16 weights
(`gemv.gemv`), in one process.

Each W4 tile knob of `w4_mma.fused_tile` (KSPLIT warps splitting K, U 128-input steps a round, MINB) is varied for one
shape at a time (the other shapes at their default), so a number is what that shape's tile does to the whole chain;
`--tiles` times given combinations. Also timed: the chain without attention, and with one shape's GEMV run twice a
layer (its marginal cost in the chain: what it adds to a layer). `--trace` replays the default chain once more with
each W4 kernel stamping its CTAs' %globaltimer (`gemv_w4_mma_fused(trace=)`) and prints, per shape, where a kernel's
time goes: the wait for the kernel ahead, staging the row, the product, the epilogue (medians over layers, ns).

    python scripts/bench_w4_chain.py [--layers 32] [--context 128] [--trace] [--out bench_results/w4_chain.json]
    python scripts/bench_w4_chain.py --no-sweep --attn-splits 1,2    # decode attention's split count in the chain
    python scripts/bench_w4_chain.py --tp 2 --bf16-only --bf16-tiles '{"qkv": {"BLOCK_N": 8, "BLOCK_K": 1024, ...}}'
        # one TP=2 rank's shapes (heads and FFN halved; no communication), bf16 gemv configs beside the default
    python scripts/bench_w4_chain.py --tp 2 --bf16-only --take --bf16-tiles '{"qkv": {...}}'
        # and as the rank's batch-1 step runs them: the embedding and the row-parallel GEMVs push into pushed-partials
        # slots, qkv and gate/up take them (both ranks' rows written here by this GPU: the take path's work without
        # NVLink), `sum_pushed` at the end; `--bf16-tiles` then sets the taking GEMVs' tiles too
Prints microseconds per layer; writes JSON.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN = 4096, 32, 8, 128, 14336
SHAPES = {"qkv": (HIDDEN + 2 * KV_HEADS * HEAD_DIM, HIDDEN), "o": (HIDDEN, HIDDEN), "gate_up": (2 * FFN, HIDDEN),
          "down": (HIDDEN, FFN)}
GROUP = 128
PAGE = 16
NORMED = ("qkv", "gate_up")  # the shapes whose kernel takes the RMSNorm prologue (and stages the row)


def rank_dims(tp: int) -> dict:
    """One TP rank's share of a Llama-3.1-8B layer (heads, KV heads and FFN split tp ways) and its GEMV shapes:
    the chain of a TP=tp rank's batch-1 step without its communication."""
    heads, kv, ffn = HEADS // tp, KV_HEADS // tp, FFN // tp
    if heads * tp != HEADS or kv * tp != KV_HEADS or ffn * tp != FFN:
        raise ValueError(f"--tp {tp} does not split {HEADS} heads, {KV_HEADS} KV heads and {FFN} FFN rows evenly")
    return {"heads": heads, "kv_heads": kv, "shapes": {"qkv": ((heads + 2 * kv) * HEAD_DIM, HIDDEN),
                                                       "o": (HIDDEN, heads * HEAD_DIM), "gate_up": (2 * ffn, HIDDEN),
                                                       "down": (HIDDEN, ffn)}}


def sweep_tiles(shape: str) -> list[dict]:
    """Tile overrides tried for one shape (each with the other shapes at `fused_tile`'s default)."""
    ksplits = {"qkv": (4, 8, 16), "o": (8, 16), "gate_up": (2, 4), "down": (8, 16)}[shape]
    out = []
    for ksplit in ksplits:
        for u in (2, 4):
            out.append(dict(KSPLIT=ksplit, U=u))
    if shape == "down":  # 112 steps over 16 warps: 7 a warp, a round of 2 leaves a lone last step (a round trip of
        # its own); 3 a round leaves one of three rounds short, 7 takes them all at once (registers: MINB 1)
        out += [dict(KSPLIT=16, U=3), dict(KSPLIT=16, U=7, MINB=1)]
    return out


class Chain:
    """`layers` decoder layers' weights, caches and inputs; `run(tiles)` is one step's chain of kernels."""

    def __init__(self, layers: int, context: int, quant: bool, tp: int = 1, device: str = "cuda",
                 dtype: torch.dtype = torch.bfloat16):
        from parallel.kernels.gemv import Rope

        self.quant, self.layers = quant, layers
        dims = rank_dims(tp)
        self.shapes, self.heads, self.kv_heads = dims["shapes"], dims["heads"], dims["kv_heads"]
        dev = device  # a CPU device and float16: Triton's interpreter (tests/test_bench_w4_chain.py)
        self.w = []
        for _ in range(layers):
            if quant:
                from scripts.bench_gemv_int4 import GROUP as INT4_GROUP, _weights

                assert INT4_GROUP == GROUP
                self.w.append({name: _weights(n, k, 1)[0] for name, (n, k) in self.shapes.items()})
            else:
                self.w.append({name: (torch.randn(n, k, device=dev) / k**0.5).to(dtype)
                               for name, (n, k) in self.shapes.items()})
        self.norm = [(torch.rand(2, HIDDEN, device=dev) + 0.5).to(dtype) for _ in range(layers)]
        blocks = -(-(context + 1) // PAGE)
        self.cache = (torch.randn(2, layers * blocks, PAGE, self.kv_heads, HEAD_DIM, device=dev) * 0.1).to(dtype)
        self.tables = [torch.arange(i * blocks, (i + 1) * blocks, device=dev, dtype=torch.int32)[None]
                       for i in range(layers)]
        self.seq_lens = torch.tensor([context + 1], device=dev, dtype=torch.int32)
        self.slots = [torch.tensor([i * blocks * PAGE + context], device=dev, dtype=torch.int64) for i in range(layers)]
        positions = torch.tensor([context], device=dev, dtype=torch.int64)
        inv = 1.0 / (500000.0 ** (torch.arange(0, HEAD_DIM, 2, device=dev).float() / HEAD_DIM))
        ang = torch.arange(context + 64, device=dev).float()[:, None] * inv[None]
        emb = torch.cat([ang, ang], -1)
        cos_sin = torch.stack([emb.cos(), emb.sin()], 1).contiguous()  # [P, 2, head_dim]
        self.rope = Rope(positions, cos_sin, HEAD_DIM, (self.heads + self.kv_heads) * HEAD_DIM)
        self.h = torch.randn(1, HIDDEN, device=dev).to(dtype)
        self.max_seq_len = 4096
        self.attn_splits: int | None = None  # decode attention's split count; None: the count a graph is captured with
        self.sites = None  # `use_pushed_partials`: s -> PushedSite, the TP step's pushed-partials sites played here
        self.traces: list[dict[str, torch.Tensor]] | None = None  # per layer, per shape: int64 [CTAs, 5] (`trace`)

    def use_pushed_partials(self, world: int = 2) -> None:
        """Run the bf16 chain as a TP rank's batch-1 step does (workers/models/fused_decode.py): the token's embedding
        and each row-parallel GEMV push into a site of pushed-partials slots, the next normed GEMV takes the site
        (waits for its rows, sums them, RMSNorms), `sum_pushed` takes the last. This GPU writes every rank's row of
        the slots itself, so the takes find them filled at once: the take path's work without NVLink's latency."""
        from parallel.p2p_allreduce import EMPTY_BITS, PushedSite

        if self.quant:
            raise ValueError("pushed partials: the bf16 chain only (the quantized GEMVs all-reduce)")
        sites = 2 * self.layers + 1
        dev, dtype = self.h.device, self.h.dtype
        self.pushed_slots = slots = torch.empty(sites, world, HIDDEN, device=dev, dtype=dtype)
        slots.view(torch.int16).fill_(EMPTY_BITS)
        row = HIDDEN * slots.element_size()
        made = [PushedSite(world, slots[s], slots[(s - 1) % sites],
                           torch.tensor([slots[s].data_ptr() + r * row for r in range(world)], device=dev))
                for s in range(sites)]
        self.sites = made.__getitem__
        self.embedding = torch.randn(64, HIDDEN, device=dev).to(dtype)
        self.token = torch.tensor([5], device=dev, dtype=torch.int64)

    def attend(self, qkv: torch.Tensor, layer: int, attention: bool = True) -> torch.Tensor:
        """Decode attention of the qkv GEMV's output [1, (heads + 2 kv) x D] -> [1, heads x D] (the new token's k/v
        written into the layer's cache); without `attention`, q passed through."""
        from parallel.kernels.paged_attention import decode_attention

        q_rows, kv_rows = self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM
        q = qkv[:, :q_rows].view(1, self.heads, HEAD_DIM)
        if not attention:
            return q.reshape(1, q_rows)
        k = qkv[:, q_rows:q_rows + kv_rows].view(1, self.kv_heads, HEAD_DIM)
        v = qkv[:, q_rows + kv_rows:].view(1, self.kv_heads, HEAD_DIM)
        att = decode_attention(q, self.cache, self.tables[layer], self.seq_lens, HEAD_DIM ** -0.5, self.max_seq_len,
                               num_splits=self.attn_splits, k_new=k, v_new=v, slot_mapping=self.slots[layer])
        return att.reshape(1, q_rows)

    def bytes_per_layer(self) -> int:
        if self.quant:
            return sum(n * k // 2 + 4 * n * (k // GROUP) for n, k in self.shapes.values())
        return sum(2 * n * k for n, k in self.shapes.values())

    def linear(self, x, layer: int, name: str, tiles: dict, **fused):
        if self.quant:
            from parallel.kernels.w4_mma import gemv_w4_mma_fused

            w = self.w[layer][name]
            trace = self.traces[layer][name] if self.traces is not None else None
            return gemv_w4_mma_fused(x, w.weight, w.scales_and_zeros, GROUP, self.shapes[name][0],
                                     tile=tiles.get(name), trace=trace, **fused)
        from parallel.kernels.gemv import gemv

        return gemv(x, self.w[layer][name], None, tiles.get(name), **fused)  # tiles: gemv configs by shape

    def packed(self, layer: int, name: str) -> torch.Tensor:
        w = self.w[layer % self.layers][name]
        return w.weight if self.quant else w

    def run(self, tiles: dict, attention: bool = True, dup: str = "") -> torch.Tensor:
        """One step's chain; `dup`: a shape whose GEMV runs a second time in each layer (its marginal cost)."""
        if self.sites is not None:
            return run_pushed(self, tiles, attention)
        h = self.h
        for i in range(self.layers):
            for _ in range(1 + (dup == "qkv")):
                qkv = self.linear(h, i, "qkv", tiles, norm_weight=self.norm[i][0], eps=1e-5, rope=self.rope)
            att = self.attend(qkv, i, attention)
            for _ in range(1 + (dup == "o")):
                h = self.linear(att, i, "o", tiles, residual=h)
            for _ in range(1 + (dup == "gate_up")):
                act = self.linear(h, i, "gate_up", tiles, norm_weight=self.norm[i][1], eps=1e-5, silu=True)
            for _ in range(1 + (dup == "down")):
                h = self.linear(act, i, "down", tiles, residual=h)
        return h


def run_pushed(chain: Chain, tiles: dict, attention: bool = True) -> torch.Tensor:
    """`Chain.run` with pushed partial sums between the GEMVs (`Chain.use_pushed_partials`)."""
    from parallel.kernels import fused_ops
    from parallel.kernels.gemv import gemv, sum_pushed

    site = chain.sites
    new_h = lambda: torch.empty(1, HIDDEN, device=chain.h.device, dtype=chain.h.dtype)  # noqa: E731
    fused_ops.vocab_rows(chain.token, chain.embedding, 0, push=site(0))
    taken = site(0)
    for i in range(chain.layers):
        w, norm = chain.w[i], chain.norm[i]
        h = new_h()
        qkv = gemv(h, w["qkv"], None, tiles.get("qkv"), norm_weight=norm[0], eps=1e-5, rope=chain.rope, take=taken)
        gemv(chain.attend(qkv, i, attention), w["o"], None, tiles.get("o"), residual=h, push=site(2 * i + 1))
        h = new_h()
        act = gemv(h, w["gate_up"], None, tiles.get("gate_up"), norm_weight=norm[1], eps=1e-5, silu=True,
                   take=site(2 * i + 1))
        gemv(act, w["down"], None, tiles.get("down"), residual=h, push=site(2 * i + 2))
        taken = site(2 * i + 2)
    return sum_pushed(taken, new_h())


def trace_phases(chain: Chain) -> dict:
    """The default W4 chain replayed with every kernel stamping its CTAs (`gemv_w4_mma_fused(trace=)`), read by
    `phases`."""
    from parallel.kernels.w4_mma import fused_ctas
    from scripts.bench_gemv import bench

    chain.traces = [{s: torch.zeros(fused_ctas(n, k, s in NORMED), 5, dtype=torch.int64, device="cuda")
                     for s, (n, k) in chain.shapes.items()} for _ in range(chain.layers)]
    try:
        bench(lambda: chain.run({}), 2)
        stamps = [{s: t.cpu().double() for s, t in layer.items()} for layer in chain.traces]
    finally:
        chain.traces = None
    return phases(stamps)


def phases(stamps: list[dict[str, torch.Tensor]]) -> dict:
    """Per shape (in a layer's kernel order, SHAPES), from each layer's [CTAs, 5] stamps (start, past the wait, staged,
    summed, done): medians over the layers (the first two and the last left out where there are 4 or more) of `lag`
    (its first CTA past the wait, after the last CTA of the kernel before it ended; o's includes the attention
    between), `stage` / `product` / `epilogue` (a CTA's time staging the row, in its main loop and partial sums,
    writing: median and slowest CTA), in the stamps' unit (ns)."""
    import statistics

    if len(stamps) < 2:
        raise ValueError("phases: at least two layers (a layer's first kernel waits for the layer before)")
    order = list(SHAPES)
    layers = range(2, len(stamps) - 1) if len(stamps) >= 4 else range(1, len(stamps))
    out = {}
    for i, s in enumerate(order):
        rows = {k: [] for k in ("lag", "stage", "stage_max", "product", "product_max", "epilogue", "epilogue_max")}
        for layer in layers:
            t = stamps[layer][s]
            before = stamps[layer][order[i - 1]] if i else stamps[layer - 1][order[-1]]
            rows["lag"].append((t[:, 1].min() - before[:, 4].max()).item())
            for name, (a, b) in {"stage": (1, 2), "product": (2, 3), "epilogue": (3, 4)}.items():
                d = t[:, b] - t[:, a]
                rows[name].append(d.median().item())
                rows[name + "_max"].append(d.max().item())
        out[s] = {k: statistics.median(v) for k, v in rows.items()}
    return out


def time_us(chain: Chain, tiles: dict, iters: int, attention: bool = True, dup: str = "") -> float:
    """Microseconds per layer of the chain replayed from a CUDA graph."""
    from scripts.bench_gemv import bench

    return 1e6 * bench(lambda: chain.run(tiles, attention, dup), iters) / chain.layers


def time_attn_splits(chain: Chain, splits: list[int], iters: int, name: str) -> list[dict]:
    """The chain with decode attention at each split count, each beside the default (its drift shows)."""
    rows = []
    for s in splits:
        chain.attn_splits = s
        try:
            us = time_us(chain, {}, iters)
        finally:
            chain.attn_splits = None
        rows.append({"splits": s, "us": us, "default_us": time_us(chain, {}, iters)})
        print(f"{name} attention in {s} splits: {us:.2f} us a layer (default {rows[-1]['default_us']:.2f})", flush=True)
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--context", type=int, default=128, help="tokens in the KV cache before this step")
    p.add_argument("--iters", type=int, default=20)
    p.add_argument("--shapes", default="qkv,o,gate_up,down", help="shapes whose tile is swept")
    p.add_argument("--no-sweep", action="store_true", help="the default tiles only")
    p.add_argument("--tiles", action="append", default=[],
                   help='a JSON {shape: tile override} timed as a whole (repeatable), e.g. \'{"o": {"U": 2}}\'')
    p.add_argument("--trace", action="store_true", help="where each W4 kernel's time goes (CTA timestamps)")
    p.add_argument("--tp", type=int, default=1, help="the chain of one TP rank's shapes (heads and FFN split tp ways)")
    p.add_argument("--bf16-tiles", action="append", default=[],
                   help='a JSON {shape: gemv config} for the bf16 chain, timed as a whole (repeatable), e.g. '
                        '\'{"qkv": {"BLOCK_N": 8, "BLOCK_K": 1024, "num_warps": 8, "num_stages": 3}}\'')
    p.add_argument("--bf16-only", action="store_true", help="the bf16 chain alone (no W4 chain, sweep or trace)")
    p.add_argument("--take", action="store_true", help="the bf16 chain with pushed partial sums between its GEMVs, "
                   "as a TP rank's batch-1 step (`Chain.use_pushed_partials`; with --tp 2 and --bf16-only)")
    p.add_argument("--attn-splits", default="", help="decode attention split counts timed beside the default "
                   "(comma list; 1: one program a KV head, no merge kernel), in the bf16 and the W4 chain")
    p.add_argument("--out", default="bench_results/w4_chain.json")
    a = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench_w4_chain needs a CUDA GPU")
    torch.manual_seed(0)
    report = {"benchmark": "w4_chain", "gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "layers": a.layers, "context": a.context,
              "tp": a.tp}
    if a.take and not a.bf16_only:
        sys.exit("--take goes with --bf16-only (the 4-bit GEMVs do not push)")
    bf16 = Chain(a.layers, a.context, quant=False, tp=a.tp)
    if a.take:
        bf16.use_pushed_partials()
        report["take"] = True
    report["bf16_us"] = time_us(bf16, {}, a.iters)
    if a.take:  # the taking GEMVs' K loops reading the parts through L1 (TANDEM_GEMV_TAKE_X=l1), then the default again
        from parallel.kernels.gemv import TAKE_X_ENV

        before = os.environ.get(TAKE_X_ENV)
        os.environ[TAKE_X_ENV] = "l1"
        try:
            report["bf16_take_x_l1_us"] = time_us(bf16, {}, a.iters)
        finally:
            os.environ.pop(TAKE_X_ENV) if before is None else os.environ.__setitem__(TAKE_X_ENV, before)
        report["bf16_again_us"] = time_us(bf16, {}, a.iters)
        print(f"take path, parts read through L1: {report['bf16_take_x_l1_us']:.2f} us a layer (past L1: "
              f"{report['bf16_us']:.2f}, again {report['bf16_again_us']:.2f})", flush=True)
    report["bf16_no_attention_us"] = time_us(bf16, {}, a.iters, attention=False)
    bf16_bytes = bf16.bytes_per_layer()
    attn_splits = [int(x) for x in a.attn_splits.split(",") if x]
    report["bf16_attn_splits"] = time_attn_splits(bf16, attn_splits, a.iters, "bf16")
    report["bf16_combined"] = []
    for spec in a.bf16_tiles:  # each beside the default again, in turn (the default's drift shows)
        tiles = json.loads(spec)
        report["bf16_combined"].append({"tiles": tiles, "us": time_us(bf16, tiles, a.iters),
                                        "default_us": time_us(bf16, {}, a.iters)})
        row = report["bf16_combined"][-1]
        print(f"bf16 {spec}: {row['us']:.2f} us a layer (default {row['default_us']:.2f})", flush=True)
    del bf16
    torch.cuda.empty_cache()
    if a.bf16_only:
        print(f"{report['gpu']}: TP={a.tp} rank{' with pushed partials' if a.take else ''}, bf16 per layer "
              f"{report['bf16_us']:.1f} us "
              f"({bf16_bytes / report['bf16_us'] / 1e3:.0f} GB/s)", flush=True)
        _write(report, a.out)
        return
    w4 = Chain(a.layers, a.context, quant=True, tp=a.tp)
    report["w4_bytes_per_layer"] = w4.bytes_per_layer()
    report["w4_default_us"] = time_us(w4, {}, a.iters)
    report["w4_default_no_attention_us"] = time_us(w4, {}, a.iters, attention=False)
    print(f"{report['gpu']}: per layer bf16 {report['bf16_us']:.1f} us ({bf16_bytes / report['bf16_us'] / 1e3:.0f} GB/s), "
          f"W4 {report['w4_default_us']:.1f} us ({report['w4_bytes_per_layer'] / report['w4_default_us'] / 1e3:.0f} GB/s), "
          f"without attention {report['bf16_no_attention_us']:.1f} / {report['w4_default_no_attention_us']:.1f} us",
          flush=True)
    report["w4_attn_splits"] = time_attn_splits(w4, attn_splits, a.iters, "W4")
    report["combined"] = []
    for spec in a.tiles:
        tiles = json.loads(spec)
        report["combined"].append({"tiles": tiles, "us": time_us(w4, tiles, a.iters)})
        print(f"{spec}: {report['combined'][-1]['us']:.2f} us a layer", flush=True)
    report["marginal_us"] = {}  # what one more GEMV of a shape adds to a layer, in the chain
    for shape in w4.shapes:
        report["marginal_us"][shape] = time_us(w4, {}, a.iters, dup=shape) - report["w4_default_us"]
    report["marginal_us"]["attention"] = report["w4_default_us"] - report["w4_default_no_attention_us"]
    print("marginal us a layer: " + ", ".join(f"{k} {v:.2f}" for k, v in report["marginal_us"].items()), flush=True)
    report["w4_default_again_us"] = time_us(w4, {}, a.iters)
    if a.trace:
        report["trace_ns"] = trace_phases(w4)
        for shape, row in report["trace_ns"].items():
            print(f"{shape:8s} " + "  ".join(f"{k} {v:6.0f}" for k, v in row.items()), flush=True)
    report["sweep"] = []
    for shape in ([] if a.no_sweep else a.shapes.split(",")):
        for tile in sweep_tiles(shape):
            try:
                us = time_us(w4, {shape: tile}, a.iters)
            except Exception as e:  # a tile that does not compile or launch is reported, not fatal
                report["sweep"].append({"shape": shape, "tile": tile, "error": str(e)[:300]})
                continue
            report["sweep"].append({"shape": shape, "tile": tile, "us": us})
        best = min((r for r in report["sweep"] if r["shape"] == shape and "us" in r), key=lambda r: r["us"])
        print(f"{shape}: best {best['tile']} {best['us']:.2f} us a layer (default {report['w4_default_us']:.2f})",
              flush=True)
    _write(report, a.out)


def _write(report: dict, out: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with open(out, "w") as f:
        json.dump(report, f, indent=1)


if __name__ == "__main__":
    main()

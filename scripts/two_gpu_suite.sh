#!/usr/bin/env bash
# The two-GPU comparisons of issues 26, 27 and 28 in one go, each layout beside its one-GPU baseline in the
# same run (Llama-3.1-8B shapes, dummy bf16). Every step has its own time limit and writes into $RES, so a
# step that fails or hangs costs only itself; RES/progress.txt says what ran, how long and its exit code.
#
#     RES=/tmp/res bash scripts/two_gpu_suite.sh [step ...]     # default: every step, in this order
#
# LIMITS="sp=200 sp_serve=380" overrides steps' time limits; SP_LENGTHS the sp step's prompt lengths, PD_RATES the
# pd step's request rates (PD_ARRIVAL_S: seconds of arrivals a rate, 15), KV_MIN_MESSAGES the kv step's message counts, KV_COPY_PROGRAMS and KV_OVERLAP_COPY_PROGRAMS its row-copy grid caps.
# Steps: tests offline latency pd kv sp ep fault (the default), and pp allreduce pd_small pd_c1 sp_serve tp_serve
# pd_trace pd_profile embed take step_ab take_qkv_tile row_reduce row_reduce2 p2p_pushed greedy_push step_times launch_mixed.
set -u
RES=${RES:-/tmp/res}
mkdir -p "$RES"
export PYTHONUNBUFFERED=1
M8B=/tmp/m8b
[ -d $M8B ] || python scripts/model_shapes.py llama-3.1-8b $M8B >/dev/null
# The served steps' gRPC stubs (a fresh host has none; needs grpcio-tools no newer than the host's grpcio): without
# them the served steps fail, so say so once in progress.txt rather than leave a traceback at the top of the output.
if ! python -m router.proto >/dev/null 2>/tmp/router_proto.log; then
  cp /tmp/router_proto.log "$RES/proto.log"
  echo "$(date -u +%H:%M:%S) no gRPC stubs (router.proto failed, see proto.log): served steps will fail" >>"$RES/progress.txt"
fi

step() {  # step NAME SECONDS COMMAND...: run it with a time limit, log to RES/NAME.log
  local name=$1 limit=$2; shift 2
  local t0=$(date +%s)
  echo "$(date -u +%H:%M:%S) start $name" >>"$RES/progress.txt"
  timeout --kill-after=20 "$limit" bash -c "$*" 2>&1 | stdbuf -oL tr '\r' '\n' | grep --line-buffered -v -e 'it/s' -e 's/it' >"$RES/$name.log"
  local rc=${PIPESTATUS[0]}
  echo "$(date -u +%H:%M:%S) done $name rc=$rc in $(( $(date +%s) - t0 )) s" >>"$RES/progress.txt"
  python -m ray.scripts.scripts stop --force >/dev/null 2>&1 || true  # a step killed by its limit may leave a Ray session behind (the module: hosts given Ray as unpacked files have no `ray` command)
}

run_tests() {  # bf16 layouts against one GPU (TP=2 batch-1 with pushed partial sums), PP=2's stage graphs against HF,
  # and the push / take kernels on one GPU
  python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k "not embedding_kernel and not slots_only and not row_reduce and not pushed_greedy" -p no:cacheprovider || return $?
  python -m pytest -q -x tests/gpu/test_multigpu.py -k "pp2 and not tp2pp2" -p no:cacheprovider || return $?
  python -m pytest -q -x tests/gpu/test_gemv.py -k "pushed or waits" -p no:cacheprovider
}
run_offline() {
  python scripts/bench_offline.py --shape llama-3.1-8b --device cuda --dtype bfloat16 --load-format dummy \
    --layouts "uni tp2 tp2+sync pp2" --isolate --num-requests 1000 --mean-input 230 --mean-output 200 \
    --max-num-seqs 256 --max-num-batched-tokens 8192 --skip-hf --profile-steps 40 --out "$RES/offline.json"
}
run_pp() {  # issue 26: PP=2 with pipelined steps (one step group per stage, max_num_seqs per group) beside one GPU, and with
  # 128 sequences per group (the same total as one GPU's 256)
  local common="--shape llama-3.1-8b --device cuda --dtype bfloat16 --load-format dummy --isolate --num-requests 600 --mean-input 230 --mean-output 200 --max-input 1024 --max-output 512 --max-model-len 2048 --max-num-batched-tokens 8192 --skip-hf"
  python scripts/bench_offline.py $common --layouts "uni pp2" --max-num-seqs 256 --out "$RES/offline_pp2.json" || return $?
  python scripts/bench_offline.py $common --layouts "pp2" --max-num-seqs 128 --out "$RES/offline_pp2_seqs128.json"
}
run_latency() {  # TP=1, TP=2 with the P2P all-reduce after each row-parallel GEMV (TANDEM_TP_PUSH_PARTIALS=0), TP=2
  # with the partial sums pushed (the default), twice; unprofiled, then TP=2 profiled. (NCCL only: add
  # "2 tp2_nop2p 1 --disable-p2p-all-reduce" to the list.)
  for v in "1 tp1 1" "2 tp2_nopush 0" "2 tp2 1" "2 tp2_again 1" "2 tp2_profiled 1 --profile-steps 16"; do
    set -- $v
    TANDEM_TP_PUSH_PARTIALS=$3 python scripts/bench_latency.py --modes graphs --tensor-parallel-size $1 --skip-hf \
      --prefill-lens 2048 --out "$RES/latency_$2.json" ${4:-} ${5:-} || return $?
  done
}
run_pd() {  # issue 27's goodput curve: each rate sends 15 s of Poisson arrivals (rate x 15 requests), so it reaches its steady state;
  # PD_DEPLOYMENTS="name=flags;..." replaces the two deployments (the first stays the baseline)
  python scripts/bench_pd_vs_colocated.py --model $M8B --device cuda \
    --serve-args "--load-format dummy --max-model-len 8192 --dtype bfloat16" \
    --deployments "${PD_DEPLOYMENTS:-colocated=--replicas 2;pd=--disaggregated}" \
    --bench-args "--input-len 2048 --output-len 256 --request-rates $PD_RATES --arrival-seconds ${PD_ARRIVAL_S:-15} --num-prompts 400 --max-token-id 100000 --ttft-slo 1 --tpot-slo 0.05 --extra-tpot-slos 0.02 --save-requests" \
    --log-dir "$RES/pd_logs" --out "$RES/pd_vs_colocated"
}
run_kv() {  # the agent as is, cut into more messages a transfer (min_messages, KV_MIN_MESSAGES), over a pair with
  # high-priority NCCL streams, and with its gather/scatter grid capped (KV_COPY_PROGRAMS), each beside raw NCCL
  python scripts/bench_kv_transfer.py --device cuda --min-messages "${KV_MIN_MESSAGES:-1,4}" --nccl-high-priority \
    --copy-programs "${KV_COPY_PROGRAMS:-66}" --overlap-copy-programs "${KV_OVERLAP_COPY_PROGRAMS:-0,132}" \
    --out "$RES/kv_transfer.json"; }
run_sp() {
  python scripts/bench_sp_prefill.py --shape llama-3.1-8b --device cuda --dtype bfloat16 \
    --lengths $SP_LENGTHS --runs 2 --layouts "sp1 sp2+ring sp2+ulysses" --out "$RES/sp_prefill"
}
run_ep() {  # issue 26: EP=2 beside one GPU on Qwen3-30B-A3B shapes, unprofiled (the goal's figure), as measured
  # on 2 x H200 on 2026-11-29
  python scripts/bench_offline.py --shape qwen3-30b-a3b --device cuda --dtype bfloat16 --load-format dummy \
    --layouts "uni ep2+async" --isolate --num-requests 600 --mean-input 230 --mean-output 200 --max-input 1024 \
    --max-output 512 --max-model-len 2048 --max-num-seqs 256 --max-num-batched-tokens 8192 --skip-hf \
    --out "$RES/ep_offline.json"
}
run_allreduce() { python scripts/bench_allreduce.py --world-size 2 --device cuda --out "$RES/allreduce.json"; }
run_pd_small() {  # issue 27: in 256 / out 64 at 32 req/s, PD goodput >= 0.95x colocated
  python scripts/bench_pd_vs_colocated.py --model $M8B --device cuda \
    --serve-args "--load-format dummy --max-model-len 8192 --dtype bfloat16" \
    --deployments "colocated=--replicas 2;pd=--disaggregated" \
    --bench-args "--input-len 256 --output-len 64 --request-rates 32 --num-prompts 400 --max-token-id 100000 --ttft-slo 1 --tpot-slo 0.05" \
    --out "$RES/pd_small"
}
run_pd_c1() {  # issue 27: concurrency-1 TTFT (<= 1.10x) and TPOT (<= 1.05x), fixed 2048 in / 128 out, PD vs colocated;
  # pd = router-driven prefill with its prefill lane (the defaults), pd-nolane = Serve calls only (--no-prefill-lane),
  # pd-decode-driven = the earlier flow (--no-router-prefill), same call;
  # PD_C1_DEPLOYMENTS="colocated;pd" runs only those of them
  local PD_C1_ALL="colocated=--replicas 2;pd=--disaggregated --local-prefill-max-tokens 0 --no-local-prefill-when-idle;pd-nolane=--disaggregated --local-prefill-max-tokens 0 --no-local-prefill-when-idle --no-prefill-lane;pd-decode-driven=--disaggregated --local-prefill-max-tokens 0 --no-local-prefill-when-idle --no-router-prefill"
  if [ -n "${PD_C1_DEPLOYMENTS:-}" ]; then  # names -> their definitions
    PD_C1_DEPLOYMENTS=$(tr ';' '\n' <<<"$PD_C1_ALL" | grep -E "^($(tr ';' '|' <<<"$PD_C1_DEPLOYMENTS"))=" | paste -sd ';')
  fi
  python scripts/bench_pd_vs_colocated.py --model $M8B --device cuda \
    --serve-args "--load-format dummy --max-model-len 8192 --dtype bfloat16 --trace-requests" --log-dir "$RES/pd_c1_logs" \
    --deployments "${PD_C1_DEPLOYMENTS:-$PD_C1_ALL}" \
    --bench-args "--length-dist fixed --input-len 2048 --output-len 128 --concurrencies 1 --num-prompts 20 --max-token-id 100000" \
    --out "$RES/pd_c1"
}
run_pd_trace() {  # where a handed-off request's time goes at 4 req/s: its timeline and each KV send's and receive's phases
  ( export TANDEM_KV_PHASES=1
    python scripts/bench_pd_vs_colocated.py --model $M8B --device cuda \
      --serve-args "--load-format dummy --max-model-len 8192 --dtype bfloat16 --trace-requests" --log-dir "$RES/pd_trace_logs" \
      --deployments "pd=--disaggregated" \
      --bench-args "--input-len 2048 --output-len 256 --request-rates 4 --num-prompts 40 --max-token-id 100000 --save-requests" \
      --out "$RES/pd_trace" ) || return $?
  grep -h "tandem.trace" "$RES/pd_trace_logs"/*.log | sed 's/^.*tandem.trace //' >"$RES/pd_trace.jsonl"
  grep -h "kv phases" "$RES/pd_trace_logs"/*.log | sed 's/^.*kv phases //' >"$RES/pd_trace_kv_phases.jsonl"
  python scripts/trace_stages.py "$RES/pd_trace.jsonl" >"$RES/pd_trace_stages.txt"
}
run_pd_profile() {  # issue 27: what limits PD's decode replica at 16 req/s: its rank's own step profile
  # (TANDEM_RANK_PROFILE), the pools' /metrics every 2 s, and 10 s of py-spy on the decode replica where py-spy is
  # installed. PD_PROFILE_{MODEL,DEVICE,DTYPE,MAX_MODEL_LEN,LENGTHS,RATE} run it elsewhere, e.g. a CPU dry run:
  # PD_PROFILE_MODEL=models/tandem-tiny PD_PROFILE_DEVICE=cpu PD_PROFILE_DTYPE=float32 PD_PROFILE_MAX_MODEL_LEN=512
  # PD_PROFILE_LENGTHS="--input-len 128 --output-len 32 --max-input-len 256 --max-token-id 500" PD_PROFILE_RATE=4
  local logs="$RES/pd_profile_logs"
  ( export TANDEM_RANK_PROFILE=40:300
    python scripts/bench_pd_vs_colocated.py --model "${PD_PROFILE_MODEL:-$M8B}" --device "${PD_PROFILE_DEVICE:-cuda}" \
      --serve-args "--load-format dummy --max-model-len ${PD_PROFILE_MAX_MODEL_LEN:-8192} --dtype ${PD_PROFILE_DTYPE:-bfloat16} --trace-requests" --log-dir "$logs" \
      --deployments "pd=--disaggregated" \
      --bench-args "${PD_PROFILE_LENGTHS:---input-len 2048 --output-len 256 --max-token-id 100000} --request-rates ${PD_PROFILE_RATE:-16} --arrival-seconds 20 --num-prompts 400 --save-requests" \
      --out "$RES/pd_profile" ) &
  local bench=$! port="" i
  for i in $(seq 1 300); do  # the server's port, once it is ready
    port=$(grep -ho "API at http://127.0.0.1:[0-9]*/v1" "$logs"/*.log 2>/dev/null | head -1 | sed 's#.*:\([0-9]*\)/v1#\1#')
    [ -n "$port" ] && break; sleep 1
  done
  sleep 8  # the warm-up requests, then the point's arrivals
  for i in $(seq 1 20); do
    echo "t=$(date +%s.%N)"; curl -s --max-time 2 "http://127.0.0.1:$port/metrics" \
      | grep -E "^tandem_(num_preemptions|num_requests_running|num_requests_waiting|kv_cache_usage)"; sleep 2
  done >"$RES/pd_profile_metrics.txt" 2>&1 &
  if command -v py-spy >/dev/null; then
    sleep 10
    local pid; pid=$(ps -eo pid,args | grep "ray::ServeReplica:.*:DecodePool" | grep -v grep | awk '{print $1}' | head -1)
    [ -n "$pid" ] && timeout 30 py-spy record -p "$pid" -d 10 -r 100 -f raw --threads --nonblocking \
      -o "$RES/pd_profile_decode_spy.txt" >/dev/null 2>&1
  fi
  wait $bench; local rc=$?; wait
  grep -h "rank profile" "$logs"/*.log | sed 's/^.*rank profile //' >"$RES/pd_profile_ranks.jsonl"
  grep -h "tandem.trace" "$logs"/*.log | sed 's/^.*tandem.trace //' >"$RES/pd_profile.jsonl"
  python scripts/trace_stages.py "$RES/pd_profile.jsonl" >"$RES/pd_profile_stages.txt" 2>&1
  return $rc
}
run_embed() {  # issue 26: batch-1 TP=2 with a rank's share of the embedding pushed into a first pushed-partials site
  # (TANDEM_TP_EMBED=push, the default since 2026-11-29), in one kernel then all-reduced (kernel), or the PyTorch form
  # (torch), beside one GPU; their tests first (one GPU: the kernel against the masked lookup; two: TP=2 batch-1
  # tokens against TP=1)
  python -m pytest -q -x tests/gpu/test_fused_ops.py -k vocab_rows -p no:cacheprovider || return $?
  python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k embedding_kernel -p no:cacheprovider || return $?
  for v in "1 tp1 push" "2 tp2_torch torch" "2 tp2 push" "2 tp2_kernel kernel" "2 tp2_again push"; do
    set -- $v
    TANDEM_TP_EMBED=$3 python scripts/bench_latency.py --modes graphs --tensor-parallel-size $1 --skip-hf \
      --prefill-lens 2048 --out "$RES/embed_$2.json" || return $?
  done
}
run_take() {  # issue 26: batch-1 TP=2 with the pushed-partials takes waiting for their slots only (TANDEM_TP_TAKE_WAIT=
  # slots) against the default (grid: the PDL wait for the kernel ahead first), twice each, beside one GPU; the one-GPU
  # take/push graph test first, the two-GPU token test last
  python -m pytest -q -x tests/gpu/test_gemv.py -k pushed_partials -p no:cacheprovider || return $?
  for v in "1 tp1 grid" "2 tp2 grid" "2 tp2_slots slots" "2 tp2_again grid" "2 tp2_slots_again slots"; do
    set -- $v
    TANDEM_TP_TAKE_WAIT=$3 timeout 150 python scripts/bench_latency.py --modes graphs --tensor-parallel-size $1 \
      --skip-hf --prefill-lens 2048 --out "$RES/take_$2.json" || return $?
  done
  python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k slots_only -p no:cacheprovider || return $?
}
batch1_tiles() {  # batch-1 bench_latency runs, one per "tp|name|TANDEM_GEMV_TAKE_TILE" argument, into $RES/<prefix>_<name>.json
  local prefix=$1 v tp name tile
  shift
  for v in "$@"; do
    IFS='|' read -r tp name tile <<<"$v"
    TANDEM_GEMV_TAKE_TILE=$tile timeout 150 python scripts/bench_latency.py \
      --modes graphs --tensor-parallel-size $tp --skip-hf --prefill-lens 2048 --out "$RES/${prefix}_$name.json" || return $?
  done
}
run_step_ab() {  # issue 26: batch-1 TP=2 with longer K steps for the GEMVs that take pushed partials (qkv, gate/up;
  # TANDEM_GEMV_TAKE_TILE), beside one GPU and the default tile; then TP=2's batch-1 tokens with tile C against TP=1.
  # (The previous call: 16-row tiles 364.5 and 256-input steps 336.1 tok/s against 384.2 / 384.5 by default.)
  local c='{"BLOCK_N":8,"BLOCK_K":1024,"num_warps":8,"num_stages":3}' d='{"BLOCK_N":8,"BLOCK_K":2048,"num_warps":8,"num_stages":2}'
  batch1_tiles ab "1|tp1|" "2|tp2|" "2|tp2_tileC|$c" "2|tp2_tileD|$d" "2|tp2_tileC_again|$c" || return $?
  TANDEM_GEMV_TAKE_TILE=$c python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k batch1_decode_matches \
    -p no:cacheprovider
}
run_take_qkv_tile() {  # issue 26: batch-1 TP=2 with the taking qkv GEMV on its longer K tile (TAKE_QKV_TILE, the default
  # since 2026-11-30: 1.610x against 1.588x) against qkv on `tile_config`'s tile for its shape (the default before),
  # gate/up on its own tile in both, beside one GPU, twice each (~5 min)
  local plain='{"qkv":{"BLOCK_N":8,"BLOCK_K":512,"num_warps":4,"num_stages":4}}'
  batch1_tiles qkv "1|tp1|" "2|tp2_plain|$plain" "2|tp2_qkv|" "2|tp2_plain_again|$plain" "2|tp2_qkv_again|"
}
run_p2p_pushed() {  # issue 26's mixed step and offline: the pushed all-reduce (TANDEM_P2P_PUSHED, opt-in) against torch's
  # P2P kernels: its one-GPU test, the kernels alone by size, its two-GPU test (tokens and log-probs equal to the P2P
  # kernels'), then offline with --step-times: one GPU and TP=2 as today, TP=2 with each of P2P_PUSHED_MODES (default
  # `on`: above 1 MB; e.g. "on from:256" in a call of its own) (~9 min)
  timeout 120 python -m pytest -q -x tests/gpu/test_pushed_reduce.py -p no:cacheprovider || return $?  # one GPU, played ranks
  timeout 150 python scripts/bench_allreduce.py --methods nccl,oneshot,twoshot,pushed \
    --sizes 64K,256K,512K,1M,2M,4M,8M,16M --out "$RES/p2p_pushed_sizes.json" || return $?
  python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k pushed_all_reduce -p no:cacheprovider || return $?
  python scripts/bench_offline.py ${ROW_REDUCE_OFFLINE/--profile-steps 40/--step-times} --layouts "uni tp2" \
    --out "$RES/p2p_pushed_off.json" || return $?
  local m
  for m in ${P2P_PUSHED_MODES:-on}; do
    TANDEM_P2P_PUSHED=$m python scripts/bench_offline.py ${ROW_REDUCE_OFFLINE/--profile-steps 40/--step-times} \
      --layouts tp2 --out "$RES/p2p_pushed_${m/:/}.json" || return $?
  done
}
run_greedy_push() {  # issue 26: batch-1 TP=2 with the TP head's greedy rows pushed to every rank instead of
  # all-gathered by NCCL (TANDEM_TP_GREEDY_GATHER=push), twice each, beside one GPU; its one-GPU test first, the
  # two-GPU token test last
  python -m pytest -q -x tests/gpu/test_greedy_kernel.py -k pushed -p no:cacheprovider || return $?
  local v
  for v in "1 tp1 nccl" "2 tp2 nccl" "2 tp2_push push" "2 tp2_again nccl" "2 tp2_push_again push"; do
    set -- $v
    TANDEM_TP_GREEDY_GATHER=$3 timeout 150 python scripts/bench_latency.py --modes graphs --tensor-parallel-size $1 \
      --skip-hf --prefill-lens 2048 --out "$RES/greedy_$2.json" || return $?
  done
  python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k pushed_greedy -p no:cacheprovider
}
run_row_reduce() {  # issue 26's mixed step, call 1 of 2: the two row-parallel layers alone by TANDEM_TP_ROW_REDUCE mode
  # (scripts/bench_row_reduce.py), then TP=2 offline (1,000 requests, every 40th step profiled: the step table) as
  # today (staged) beside one GPU, written straight into the P2P buffer (direct) and in 2 chunks overlapped (~6 min)
  timeout 120 python scripts/bench_row_reduce.py --world-size 2 --device cuda --out "$RES/row_reduce_layers.json" || return $?
  local m
  for m in staged direct overlap:2; do
    TANDEM_TP_ROW_REDUCE=$m python scripts/bench_offline.py $ROW_REDUCE_OFFLINE --layouts "$([ $m = staged ] && echo 'uni tp2' || echo tp2)" \
      --out "$RES/row_reduce_${m/:/}.json" || return $?
  done
}
run_row_reduce2() {  # call 2 of 2: one GPU beside TP=2 with `direct` (the default since call 1), TP=2 staged
  # again, then the modes' GPU test (~6 min)
  python scripts/bench_offline.py $ROW_REDUCE_OFFLINE --layouts "uni tp2" --out "$RES/row_reduce_direct2.json" || return $?
  TANDEM_TP_ROW_REDUCE=staged python scripts/bench_offline.py $ROW_REDUCE_OFFLINE --layouts "tp2" \
    --out "$RES/row_reduce_staged_again.json" || return $?
  python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k row_reduce -p no:cacheprovider
}
run_step_times() {  # issue 26: offline TP=2 and its mixed step beside one GPU with no rank profile (--step-times: the
  # driver's step table only; until 2026-11-30 a rank profile stopped the in-process engine's launch-ahead), two rounds (~6 min)
  python scripts/bench_offline.py ${ROW_REDUCE_OFFLINE/--profile-steps 40/--step-times} --layouts "uni tp2" --repeat 2 \
    --out "$RES/step_times.json"
}
run_launch_mixed() {  # steps that hold prefill chunks launched (TANDEM_LAUNCH_MIXED=1) against run whole, offline
  # with --step-times, in LAUNCH_MIXED_LAYOUTS (default `uni`: runs on one H200; on two GPUs "uni tp2" with
  # LAUNCH_MIXED_ROUNDS=1 fits the limit), interleaved LAUNCH_MIXED_ROUNDS times (default 2); its GPU test first
  python -m pytest -q -x tests/gpu/test_launch_mixed.py -p no:cacheprovider || return $?
  if [[ "${LAUNCH_MIXED_LAYOUTS:-uni}" == *tp* ]]; then  # the TP=2 ranks' test too
    python -m pytest -q -x -s tests/gpu/test_two_gpu_bf16.py -k launched_mixed -p no:cacheprovider || return $?
  fi
  local r m
  for r in $(seq "${LAUNCH_MIXED_ROUNDS:-2}"); do
    for m in 0 1; do
      TANDEM_LAUNCH_MIXED=$m python scripts/bench_offline.py ${ROW_REDUCE_OFFLINE/--profile-steps 40/--step-times} \
        --layouts "${LAUNCH_MIXED_LAYOUTS:-uni}" --out "$RES/launch_mixed_${r}_$m.json" || return $?
    done
  done
}
run_tp_serve() {  # issue 26: the served app, one TP=2 replica against one TP=1 replica, one client (TPOT)
  python scripts/bench_pd_vs_colocated.py --model $M8B --device cuda \
    --serve-args "--load-format dummy --max-model-len 8192 --dtype bfloat16" --log-dir "$RES/tp_serve_logs" \
    --deployments "tp1=--replicas 1;tp2=--replicas 1 --tensor-parallel-size 2" \
    --bench-args "--length-dist fixed --input-len 512 --output-len 256 --concurrencies 1 --num-prompts 12 --max-token-id 100000" \
    --out "$RES/tp_serve"
}
run_sp_serve() {  # issue 28: an SP=2 prefill pool hands 16K-token prompts' KV to a TP=1 decode pool, served.
  # Three ranks on two GPUs: the prefill ranks take 0.75 of a GPU each (so Ray puts them on different GPUs)
  # and the decode rank the 0.25 left on one of them; their memory shares add up to under one GPU.
  python scripts/bench_pd_vs_colocated.py --model $M8B --device cuda \
    --serve-args "--load-format dummy --max-model-len 32768 --dtype bfloat16" \
    --deployments "sp2-prefill=--disaggregated --local-prefill-max-tokens 0 --no-local-prefill-when-idle --prefill-args '{\"sequence_parallel_size\":2,\"max_num_batched_tokens\":16384,\"gpus_per_rank\":0.75,\"gpu_memory_utilization\":0.6}' --decode-args '{\"gpus_per_rank\":0.25,\"gpu_memory_utilization\":0.33}'" \
    --bench-args "--length-dist fixed --input-len 16000 --max-input-len 16000 --output-len 32 --concurrencies 1 --num-prompts 4 --max-token-id 100000" \
    --ready-timeout 240 --log-dir "$RES/sp_serve_logs" --out "$RES/sp_serve"
}
run_fault() {
  python scripts/fault_load.py --model models/tandem-tiny --rate 4 --duration 60 \
    --serve-args "--device cuda --disaggregated --local-prefill-max-tokens 0 --no-local-prefill-when-idle --max-request-body-bytes 65536 --request-timeout-s 30" \
    --schedule "kill-prefill-rank@10,kill-prefill@25,kill-decode@40" --out "$RES/fault_load_gpu.json"
}

SP_LENGTHS=${SP_LENGTHS:-16384,65536,131056}
ROW_REDUCE_OFFLINE="--shape llama-3.1-8b --device cuda --dtype bfloat16 --load-format dummy --isolate --num-requests 1000 --mean-input 230 --mean-output 200 --max-num-seqs 256 --max-num-batched-tokens 8192 --skip-hf --profile-steps 40"
PD_RATES=${PD_RATES:-2,4,8,16,24}
export RES M8B SP_LENGTHS PD_RATES ROW_REDUCE_OFFLINE
export -f batch1_tiles run_tests run_offline run_pp run_latency run_embed run_take run_step_ab run_take_qkv_tile run_row_reduce run_row_reduce2 run_p2p_pushed run_greedy_push run_step_times run_launch_mixed run_pd run_kv run_sp run_ep run_fault run_allreduce run_pd_small run_pd_c1 run_sp_serve run_tp_serve run_pd_trace run_pd_profile
declare -A LIMIT=([tests]=420 [offline]=540 [pp]=300 [latency]=580 [pd]=720 [kv]=150 [sp]=570 [ep]=540 [fault]=300
                 [allreduce]=120 [pd_small]=420 [pd_c1]=540 [sp_serve]=420 [tp_serve]=300 [embed]=480 [take]=560 [step_ab]=560 [take_qkv_tile]=420 [row_reduce]=560 [row_reduce2]=560 [p2p_pushed]=590 [greedy_push]=560 [step_times]=560 [launch_mixed]=580 [pd_trace]=240 [pd_profile]=240)
for kv in ${LIMITS:-}; do LIMIT[${kv%%=*}]=${kv#*=}; done  # e.g. LIMITS="sp=200 sp_serve=380"
STEPS=${*:-tests offline latency pd kv sp ep fault}
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv >"$RES/env.txt" 2>&1
nvidia-smi topo -m >>"$RES/env.txt" 2>&1
for s in $STEPS; do step "$s" "${LIMIT[$s]}" "run_$s"; done
echo "$(date -u +%H:%M:%S) all done" >>"$RES/progress.txt"

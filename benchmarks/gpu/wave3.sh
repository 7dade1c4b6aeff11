#!/usr/bin/env bash
# Third-wave H200 measurements, one phase after another, each under its own time limit, every log
# and result JSON copied to $OUT as soon as the phase ends (so a cut-short run still reports).
#   on the CUDA host, after part A is in /tmp/mlxpay (../shared/GPU.md):
#   bash benchmarks/gpu/wave3.sh blocks speculative structured     # one device call
#   bash benchmarks/gpu/wave3.sh host                              # the next, while the machine is warm
#   bash benchmarks/gpu/wave3.sh host_ssd flush                    # issue 28's goals with the SSD tier, flush speed
#   bash benchmarks/gpu/wave3.sh host_ram                          # the same without SSD (host tier, RAM only)
#   bash benchmarks/gpu/wave3.sh simttft                           # mlxd simulate TTFT per tier vs a recording
#   bash benchmarks/gpu/wave3.sh restorepaths                      # the probe's restore vs serving's, one process
#   bash benchmarks/gpu/wave3.sh revsplit                          # recompute a prefix's head while its tail is read
#   bash benchmarks/gpu/wave3.sh apartbatch                        # a lone long prompt: prefilled in the batch vs apart
#   bash benchmarks/gpu/wave3.sh struct1 struct8                   # structured decode paired with free, b1 then b8
#   bash benchmarks/gpu/wave3.sh spec1 spec8                       # speculation vs off, bracketed runs, b1 then b8
#   bash benchmarks/gpu/wave3.sh speck                             # n-gram draft lengths: K = 4 / 16, chosen vs fixed
#   bash benchmarks/gpu/wave3.sh vshapes                           # a short forward's cost per new key length
#   bash benchmarks/gpu/wave3.sh wbgaps                            # decode's step gaps beside write-behind
#   bash benchmarks/gpu/wave3.sh decodeab                          # decode 1 / 8 streams, servers interleaved
#   bash benchmarks/gpu/wave3.sh decodeil                          # decode vs mlx_lm, servers interleaved
#   bash benchmarks/gpu/wave3.sh ttftil                            # a RAM hit and the next turn, servers interleaved
#   bash benchmarks/gpu/wave3.sh stephost                          # decode's host cost per step, one process
#   bash benchmarks/gpu/wave3.sh carry                             # a row that ends carried one step vs filtered, one process
#   bash benchmarks/gpu/wave3.sh flushtrace flush                  # the flush path on this disk, then a SIGTERM flush
#   bash benchmarks/gpu/wave3.sh firstprefill                      # a fresh process's first 16k prefills, chunk by chunk
#   bash benchmarks/gpu/wave3.sh contigkv                          # after a short prefix: aligned chunks, sliced vs contiguous keys
#   bash benchmarks/gpu/wave3.sh unfusedarea                       # new-length prompts and suffixes: cuDNN graph vs plain ops
#   bash benchmarks/gpu/wave3.sh plansnap                          # a checkpoint's write plan on the engine thread, by part
#   bash benchmarks/gpu/wave3.sh dlpackcopy                        # a plan's bytes by DLPack pointer + DMA, not the host read
#   bash benchmarks/gpu/wave3.sh devptr                            # a plan's bytes by device address (custom kernel) + DMA
#   bash benchmarks/gpu/wave3.sh manageddecode                     # decode on KV memory the SSD tier's host access touched
#   bash benchmarks/gpu/wave3.sh finalplan                         # MLXD_FINAL_PLAN arms (and RAM only) in one process, 8 rows ending over 2 steps (~4 min)
#   bash benchmarks/gpu/wave3.sh sidestream                        # a copy evaluated behind a dispatched forward, same or side stream
set -u
OUT=${OUT:-/tmp/wave3}; mkdir -p "$OUT"
source .gpu/b/install.sh || exit 9
touch /tmp/wave3.start
nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv,noheader > "$OUT/gpu.txt" 2>&1
phase() {  # NAME SECONDS CMD...   (LIMIT_NAME=seconds in the environment overrides a phase's limit)
  local name=$1 limit=$2; shift 2
  local override="LIMIT_$name"; limit=${!override:-$limit}
  echo "=== $name start $(date +%T) limit ${limit}s"
  timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
  echo "=== $name rc=$? end $(date +%T)"; tail -n 25 "$OUT/$name.log"
  find benchmarks/results -newer /tmp/wave3.start -name '*.json' -exec cp {} "$OUT/" \; 2>/dev/null
  # a phase's own folder's JSON also gzipped beside it (11:07 2026-12-07: ttftil's did not come back from the device)
  for f in "$OUT/$name"/*.json; do [ -f "$f" ] && gzip -c "$f" > "$OUT/$name-$(basename "$f").gz"; done 2>/dev/null
}
for p in "$@"; do case $p in
  blocks) mkdir -p /tmp/blocks; phase blocks 150 python3 benchmarks/bench_ssd_blocks.py --parts storage bandwidth \
            --readers 8 --dir /tmp/blocks --out "$OUT" ${BLOCKS_ARGS:---block-tokens 1024 256 --rounds 6} ;;
  speculative) phase speculative 170 python3 benchmarks/gpu/bench_speculative_gpu.py --rounds 3 --tokens 96 \
            --batch 1 8 --temperature 4 --draft-self --draft-preset default --no-repeat-check --stop-after 90 \
            ${SPEC_ARGS:-} ;;
  # Issue 23's side by side with the noise controlled: each arm between two off runs (--schedule bracket: no core
  # twice in a row), many short rounds, ratio median + IQR, ÷ off2 (the equal-arm control) per round, CPU ms per
  # token; one batch each; --budget fits both cases in the phase's limit whatever the model build took.
  spec1) phase spec1 170 python3 benchmarks/gpu/bench_speculative_gpu.py --batch 1 --rounds 40 --tokens 48 \
            --temperature 4 --draft-self --draft-preset default --no-repeat-check --control --schedule bracket \
            --budget $(( ${LIMIT_spec1:-170} - 14 )) ${SPEC1_ARGS:-} ;;
  spec8) phase spec8 170 python3 benchmarks/gpu/bench_speculative_gpu.py --batch 8 --rounds 40 --tokens 48 \
            --temperature 4 --draft-self --draft-preset default --no-repeat-check --control --schedule bracket \
            --budget $(( ${LIMIT_spec8:-170} - 14 )) ${SPEC8_ARGS:-} ;;
  # Issue 23's draft lengths: n-gram at K = 4 and 16, each try's length chosen from what verifying costs vs every try
  # K (`... fixed`), bracketed, repetitive (acceptance ~1), t = 2 (partial) and t = 4 (~0), batch 1 then 8.
  speck) phase speck 280 python3 benchmarks/gpu/bench_speculative_gpu.py --batch 1 8 --rounds 40 --tokens 48 \
            --temperature 2 4 --k 4 --ngram-k 16 --fixed-lengths --no-repeat-check --control --schedule bracket \
            --budget $(( ${LIMIT_speck:-280} - 14 )) ${SPECK_ARGS:-} ;;
  # Issue 23: what a forward of 1 (decode), 5 (a verify), 17 and 64 (a draft's catch-ups) queries costs at 20
  # consecutive key lengths, first call vs second, over MLX's kernel (exact keys / whole buffer) and routed.
  vshapes) phase vshapes 90 python3 benchmarks/gpu/verify_shapes.py ${VSHAPES_ARGS:-} ;;
  numerics) phase numerics 100 python3 benchmarks/gpu/verify_numerics.py ${NUMERICS_ARGS:---prompt 512 --tokens 192} ;;
  rollback) phase rollback 60 python3 benchmarks/bench_rollback.py ${ROLLBACK_ARGS:---shape qwen3-1.7b --context 512 2048 8192} ;;
  verify) phase verify 120 python3 benchmarks/bench_verify_step.py --bf16-shape qwen3-1.7b ${VERIFY_ARGS:---span 256 --tokens 96 --rounds 5} ;;
  structured) phase structured 130 python3 benchmarks/gpu/bench_structured_gpu.py ${STRUCT_ARGS:---rounds 6 --tokens 192} ;;
  struct1) phase struct1 150 python3 benchmarks/gpu/bench_structured_gpu.py --pairs --batch 1 --decode-only --tokens 48 \
            --rounds 40 --stop-after $(( ${LIMIT_struct1:-150} - 60 )) ${STRUCT1_ARGS:---mask-modes ahead-early ahead-steal ahead-early+early} ;;
  struct8) phase struct8 150 python3 benchmarks/gpu/bench_structured_gpu.py --pairs --batch 8 --decode-only --tokens 48 \
            --rounds 40 --stop-after $(( ${LIMIT_struct8:-150} - 25 )) ${STRUCT8_ARGS:---mask-modes ahead-early ahead-steal ahead-early:2} ;;
  structprof) phase structprof 90 python3 benchmarks/gpu/bench_structured_gpu.py --prof \
            ${STRUCTPROF_ARGS:---batch 8 --tokens 128 --mask-modes ahead-bool ahead-early ahead-early:2 ahead-bool/0.5} ;;
  vision) phase vision 170 python3 benchmarks/gpu/bench_vision_gpu.py ${VISION_ARGS:-} ;;
  host) phase host 540 python3 benchmarks/gpu/bench_host_tier_servers.py --out "$OUT/host" \
            --rounds ${HOST_ROUNDS:-1} ;;
  host_ssd) phase host_ssd 480 python3 benchmarks/gpu/bench_host_tier_servers.py --out "$OUT/host" \
            --servers mlx_lm,mlxd_host_ssd --rounds ${HOST_ROUNDS:-2} ${HOST_ARGS:-} ;;
  host_ram) phase host_ram 360 python3 benchmarks/gpu/bench_host_tier_servers.py --out "$OUT/host" \
            --servers mlx_lm,mlxd_host,mlxd_ram --rounds ${HOST_ROUNDS:-2} ${HOST_ARGS:-} ;;
  flush) phase flush 150 python3 benchmarks/bench_flush.py --preset qwen3-1.7b --conversations 6 \
            --rounds 1 --work /tmp/host-servers-work --out "$OUT/flush" ${FLUSH_ARGS:-} ;;
  # Issue 28, the flush path alone on this disk: one 8k checkpoint of the 1.7B shape written as a flush writes it, staged
  # through the real CUDA runtime, traced (first byte, blocks in flight, idle writer-seconds, final fsyncs, manifest);
  # arms per round: a write begun beside decode with the flush arriving mid-block, the code before the 23:30 hand-off and
  # split tail (beside/old) and now (beside); an idle-begun flush with 4 and 8 block writers; no model build (~40 s).
  # Issue 28: a restarted server's first recomputes, chunk by chunk in fresh processes (none / a warm-up first).
  firstprefill) phase firstprefill 90 python3 benchmarks/gpu/probe_first_prefill.py --json "$OUT/first-prefill.json" \
            ${FIRSTPREFILL_ARGS:-} ;;
  # Issue 28: a prefill after a short cached prefix, aligned chunks, keys as slices vs contiguous (~60 s).
  contigkv) phase contigkv 90 python3 benchmarks/gpu/probe_contiguous_kv.py ${CONTIGKV_ARGS:-} ;;
  # Issue 28: prompts and suffixes of new lengths, cuDNN's graph per shape vs plain-op attention (MLXD_UNFUSED_AREA).
  unfusedarea) phase unfusedarea 120 python3 benchmarks/gpu/probe_unfused_area.py --json "$OUT/unfused-area.json" \
            ${UNFUSEDAREA_ARGS:-} ;;
  flushtrace) phase flushtrace 60 python3 benchmarks/trace_flush.py --cuda real --tokens 8192 --block-tokens 256 \
            --rounds 4 --arms beside/old,beside,new,new:8 --dir /tmp --out "$OUT/flushtrace" ${FLUSHTRACE_ARGS:-} ;;
  simttft) phase simttft 150 python3 benchmarks/gpu/bench_sim_ttft_gpu.py \
            --stop-after $(( ${LIMIT_simttft:-150} - 12 )) ${SIMTTFT_ARGS:-} ;;
  # Issue 28, a split whose halves overlap: a 16k prefix's head recomputed while its tail's KV is read from disk
  # on a thread, vs recompute and restore (one process, page cache dropped before each read; ~2 min with the build)
  revsplit) phase revsplit 170 python3 benchmarks/gpu/probe_reverse_split.py --out "$OUT" ${REVSPLIT_ARGS:-} ;;
  # Issue 28's lead: a lone long prompt's first token prefilled in the engine's batch vs apart on its own caches
  # (one EngineCore, 4k and 16k tokens, arms alternating; ~1 min with the build)
  apartbatch) phase apartbatch 120 python3 benchmarks/gpu/probe_apart_vs_batch.py --out "$OUT" ${APARTBATCH_ARGS:-} ;;
  restorepaths) phase restorepaths 120 python3 benchmarks/gpu/probe_restore_paths.py --out "$OUT" \
            ${RESTOREPATHS_ARGS:-} ;;
  # Issue 28, decode beside write-behind: the steps and the gaps between them per level, a fresh 8k prompt (its
  # write-behind runs during the decode) before levels 1 and 3, the same prompt again (nothing to write) before 2 and 4.
  wbgaps) rm -rf /tmp/wbgaps-ssd; phase wbgaps 150 python3 benchmarks/gpu/profile_decode_gaps.py --out "$OUT/wbgaps" \
            --model ${WBGAPS_MODEL:-/tmp/host-servers-work/model-qwen3-1.7b-shape} --tokens 256 --streams 1,1,8,8 \
            --fresh-tokens 8192 --fresh-pattern 1,0,1,0 --sample-ms 1000 \
            --serve-args "--ssd-cache /tmp/wbgaps-ssd --host-cache-gb 24 --prompt-cache-gb 3 ${WBGAPS_SERVE:-}" \
            ${WBGAPS_ARGS:-} ;;
  # Issue 28's decode goal with the host's drift spread over every arm: mlx_lm, a second mlx_lm (the noise floor),
  # mlxd RAM only and mlxd + host tier + SSD all up at once; each round a fresh 8k prompt then 1 and 8 streams on
  # every server in a rotated order; per-round ratios to mlx_lm (median, IQR, min). Builds the model if missing.
  decodeab) phase decodeab 260 python3 benchmarks/bench_decode_ab.py --model /tmp/host-servers-work/model-qwen3-1.7b-shape \
            --arm mlxd=src --ssd --fresh-all --control --tokens 256 --fresh-tokens 8192 --rounds 30 \
            --serve-args "--prompt-cache-gb 3" --ssd-args "--host-cache-gb 24" --out "$OUT" --copy-logs \
            --budget $(( ${LIMIT_decodeab:-260} - 25 )) ${DECODEAB_ARGS:-} ;;
  # Issue 28's decode goal through this host's drift: every server up at once, short rounds each visiting every
  # server at each level (orders balanced for position and neighbour, mlx_lm twice: the control), a fresh 8k prompt before each run (the SSD
  # server's write-behind runs during its decode), ratio to mlx_lm per round, median + IQR; --budget ends the
  # rounds in time for the stops, the flush and the summary.
  # A RAM hit and the next turn with every server up, interleaved per round (the first token early ÷ late over HTTP).
  ttftil) phase ttftil 240 python3 benchmarks/gpu/bench_host_tier_servers.py --out "$OUT/ttftil" --rounds 0 \
            --servers ${TTFTIL_SERVERS:-mlx_lm,mlxd_ram,mlxd_ram_late} --streams "" --ttft-rounds 60 \
            --ttft-tokens ${TTFTIL_TOKENS:-4096} --budget $(( ${LIMIT_ttftil:-240} - 35 )) ${TTFTIL_ARGS:-} ;;
  decodeil) phase decodeil 240 python3 benchmarks/gpu/bench_host_tier_servers.py --out "$OUT/decodeil" --rounds 0 \
            --servers mlx_lm,mlxd_ram,mlxd_host_ssd --streams 1,8 --prompt-tokens 8192 --decode-tokens 64 \
            --decode-rounds 40 --budget $(( ${LIMIT_decodeil:-240} - 35 )) ${DECODEIL_ARGS:-} ;;
  # Issue 28, decode's host cost per step in one process: mlx_lm's BatchGenerator.next vs EngineCore.step on the
  # 1.7B shape (built by decodeil/host if missing: the preset), 1 and 8 rows interleaved: the engine thread's CPU per
  # step outside the device waits, syncs, pipelining, Python calls / bytecodes; then with logprobs (top 3), the wall
  # the reads after the tokens wait (mlx_lm.server's per-row reads vs the core's one read on a side stream).
  # Issue 28, when a finished row's final checkpoint is taken (MLXD_FINAL_PLAN), in one process (no HTTP, no other
  # servers): 8 rows on 8k-token prompts ending over 2 steps, the SSD tier's plans beside RAM only, arms interleaved
  # round by round; the ending steps taken apart (time in mlx-lm's next: the batch filter; the leaving rows' plans);
  # +mlxfilter: rows leave the batch by mlx-lm's own filter, which waits for the forward in flight (MLXD_BATCH_FILTER);
  # +planmain: the write plans' slices on the generation stream, behind the forward in flight (MLXD_PLAN_STREAM=main);
  # +hostread: the write plans' buffers host views (converted to managed memory), not device addresses (MLXD_PLAN_DEVICE=0)
  finalplan) M=/tmp/host-servers-work/model-qwen3-1.7b-shape
            [ -f $M/config.json ] || python3 -c "import sys; sys.path[:0] = ['benchmarks/gpu', 'benchmarks']
from pathlib import Path; from bench_gpu import QWEN3_1_7B, built; built(QWEN3_1_7B, Path('/tmp/host-servers-work'))"
            phase finalplan 240 python3 benchmarks/bench_final_plan.py --model $M --prompt 8192 --tokens 64 --rounds 12 \
            --ssd --work /tmp/final-plan-work --out "$OUT" --budget $(( ${LIMIT_finalplan:-240} - 70 )) \
            ${FINALPLAN_ARGS:---arms after-forward,after-forward+hostread,after-forward@ram,after-forward+mlxfilter,with-token} ;;
  # Issue 28, a row that ends while others decode carried one step (MLXD_CARRY_ROWS) vs filtered at once, in one
  # process: 8 rows of one 8k-token prompt on the 1.7B shape, the first ending 1 / 2 / 20 steps early; the step after
  # it ends (mlx-lm's gather of the seven before the next forward) and the whole decode, arms interleaved per round.
  carry) M=/tmp/host-servers-work/model-qwen3-1.7b-shape
            [ -f $M/config.json ] || python3 -c "import sys; sys.path[:0] = ['benchmarks/gpu', 'benchmarks']
from pathlib import Path; from bench_gpu import QWEN3_1_7B, built; built(QWEN3_1_7B, Path('/tmp/host-servers-work'))"
            phase carry 150 python3 benchmarks/bench_carry_rows.py --model $M --context 8192 --rows 8 --tokens 64 \
            --rounds 10 --out "$OUT" ${CARRY_ARGS:---early 1 2 20} ;;
  stephost) M=/tmp/host-servers-work/model-qwen3-1.7b-shape
            [ -f $M/config.json ] || python3 -c "import sys; sys.path[:0] = ['benchmarks/gpu', 'benchmarks']
from pathlib import Path; from bench_gpu import QWEN3_1_7B, built; built(QWEN3_1_7B, Path('/tmp/host-servers-work'))"
            phase stephost 150 python3 benchmarks/bench_step_host.py --model $M --repeats 6 --steps 150 --out "$OUT" ${STEPHOST_ARGS:-}
            phase stephostlp 100 python3 benchmarks/bench_step_host.py --model $M --repeats 3 --steps 100 --logprobs 3 \
              --label logprobs --out "$OUT" ;;
  # Issue 28: the SSD server's prompt checkpoint took 46-152 ms of TTFT (RAM only: 2.5-6 ms): kinds.plan_snapshot
  # on KV of the 1.7B shape, whole and by part (slice + eval; the memoryviews, first and again; DLPack), no model.
  plansnap) phase plansnap 90 python3 benchmarks/gpu/time_plan_snapshot.py --tokens 8192 16384 --rounds 3 \
            --json "$OUT/plan-snapshot-h200.json" ${PLANSNAP_ARGS:-} ;;
  # Issue 28, a write plan's bytes without the host read that converts them: DLPack's pointer and a DMA into pinned
  # memory against the memoryview (the plan's path now), on fresh 8k-token KV; the same bytes?
  dlpackcopy) phase dlpackcopy 60 python3 benchmarks/gpu/probe_dlpack_copy.py --tokens 8192 --rounds 3 \
            --json "$OUT/dlpack-copy.json" ${DLPACKCOPY_ARGS:-} ;;
  # Issue 28, a write plan's bytes by device address (a custom kernel reads it) + DMA into pinned memory, against the
  # memoryview's conversion, alone and beside a queue of matmuls (runtime/device_pointers.py)
  devptr) phase devptr 90 python3 benchmarks/gpu/probe_device_pointer.py --tokens 8192 --rounds 3 \
            --json "$OUT/device-pointer.json" ${DEVPTR_ARGS:-} ;;
  # Issue 28, the 8-stream decode gap with the SSD tier: decode's attention on KV buffers the SSD tier's host access
  # touched (converted to managed memory, staged, advised read-mostly and read, read) vs never touched, on those
  # buffers and on new ones MLX's cache recycles from them; no model (~1-2 min on the 1.7B shape).
  manageddecode) phase manageddecode 150 python3 benchmarks/gpu/probe_managed_decode.py --json "$OUT/managed-decode.json" \
            ${MANAGEDDECODE_ARGS:---cases 8x8192 1x16384 --steps 48 --rounds 2} ;;
  # Issue 28, the end-of-decode gaps: a small copy evaluated right after a dispatched forward, on its stream or a
  # side one (does a finishing row's checkpoint copy wait for the next forward?), no model.
  sidestream) phase sidestream 60 python3 benchmarks/probe_side_stream_eval.py ${SIDESTREAM_ARGS:---size 8192 --matmuls 4 --rounds 5} ;;
  probe) phase probe 300 python3 benchmarks/gpu/probe_host_tier.py --out "$OUT/probe" --rounds 2 ${PROBE_ARGS:-} ;;
  *) echo "unknown phase $p" ;;
esac; done
echo "=== all done $(date +%T)"

#!/bin/sh
# Every checked-in result under simulations/results/ comes from one line here.
# Run from the repo root: sh simulations/scenarios.sh
set -e
PY=${PY:-/tmp/venv/bin/python}
SIM="$PY -m mlxd.sim.cli"   # same as `mlxd simulate`
R=simulations/results
T=${TRACES:-../shared/traces}

# 1. Blocks model, unlimited: check against Mooncake FAST'25 Table 2 (40% / 66%).
$SIM $T/conversation_trace.jsonl --cache-model blocks --policy lru --sweep inf --name conversation_blocks_unlimited --out $R
$SIM $T/synthetic_trace.jsonl --cache-model blocks --policy lru --sweep inf --name synthetic_blocks_unlimited --out $R

# 2. Six RAM capacities x three policies, both cache models (RAM only).
$SIM $T/conversation_trace.jsonl --cache-model blocks --sweep --name conversation_blocks --out $R
$SIM $T/conversation_trace.jsonl --cache-model mlxd --sweep --name conversation_mlxd --out $R
$SIM $T/synthetic_trace.jsonl --sweep --name synthetic --out $R

# 3. RAM sweep with a 400 GiB SSD tier (persist-before-demotion), CPU cost model.
$SIM $T/conversation_trace.jsonl --cache-model mlxd --sweep --ssd-gb 400 --name conversation_mlxd_ssd400 --out $R

# 4. Same with a GPU-like cost model (an ESTIMATE, see cost_models/), 64 slots:
#    prefill is so fast there that restoring from SSD often loses to recompute.
$SIM $T/conversation_trace.jsonl --cache-model mlxd --sweep --ssd-gb 400 --slots 64 \
    --cost-model simulations/cost_models/h200-qwen3-1.7b-estimate.json \
    --name conversation_mlxd_ssd400_h200est --out $R

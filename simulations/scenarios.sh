#!/bin/sh
# Every checked-in result under simulations/results/ comes from one line here.
# Run from the repo root: sh simulations/scenarios.sh
set -e
PY=${PY:-/tmp/venv/bin/python}
SIM="$PY -m mlxd.sim.cli"   # same as `mlxd simulate`
R=simulations/results
T=${TRACES:-simulations/traces}

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

# 5. A fleet: 4 replicas (16 slots and 2,000 or 10,000 blocks of RAM each) behind each router,
#    GPU-like cost model; and one server with the whole fleet's RAM and slots for reference.
$SIM $T/conversation_trace.jsonl --replicas 4 --router round_robin,session,cache_aware --policy lru \
    --sweep 2000,10000 --slots 16 --cost-model simulations/cost_models/h200-qwen3-1.7b-estimate.json \
    --name conversation_fleet4_h200est --out $R
$SIM $T/conversation_trace.jsonl --cache-model mlxd --policy lru --sweep 8000,40000 --slots 64 \
    --cost-model simulations/cost_models/h200-qwen3-1.7b-estimate.json \
    --name conversation_one_server_4x_h200est --out $R

#!/usr/bin/env bash
# Run a command with its reads from one disk throttled (a cgroup v1 blkio limit, root only): the CPU's
# stand-in for a disk slower than recomputing (the H200's regime after a restart, issue 28), e.g.
#   bash benchmarks/slow_disk.sh 8000000 /tmp/host-servers-work python benchmarks/gpu/bench_host_tier_servers.py ...
# BYTES_PER_S: the read limit; DIR: a directory on the disk to throttle. Page-cache hits are not throttled.
# Writes are not limited (v1 charges buffered writes to the flusher, not the writer).
set -eu
rate=$1 dir=$2; shift 2
mkdir -p "$dir"
dev=$(df --output=source "$dir" | tail -n 1)
majmin=$(lsblk -no MAJ:MIN "$dev" | head -n 1 | tr -d ' ')
cg=/sys/fs/cgroup/blkio/mlxd-slow-disk-$$
mkdir "$cg"
trap 'echo $$ > /sys/fs/cgroup/blkio/cgroup.procs; rmdir "$cg" 2>/dev/null || true' EXIT
echo "$majmin $rate" > "$cg/blkio.throttle.read_bps_device"
echo $$ > "$cg/cgroup.procs"  # this shell and everything it starts
echo "slow_disk: reads from $dev ($majmin) at most $rate B/s" >&2
"$@"

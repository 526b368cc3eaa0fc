#!/usr/bin/env bash
# The emulated cluster's headline benchmarks on a machine with a core per rank:
#   benchmarks/cluster_check.sh OUT_DIR
# Made for the lent GPU machine (16 cores, root), whose CPUs give every rank of
# P = 8 and of 2 nodes x 4 ranks a core of its own (the development machine has 2
# cores: 8 ranks share them there). Runs, one after another, with nothing else:
#   1. issue 35's setting: P = 8, 1 Gbit/s, N = 16M, d = 0.781%, `sparcml bench`;
#   2. issue 31's setting: 2 nodes x 4 ranks, one 1 Gbit/s NIC per node, the same;
#   3. the transport floor at P = 2 and P = 8 (benchmarks/transport_floor.py).
# Nothing is installed: sparcml is imported from src/ (PYTHONPATH) by the machine's
# python3. Where `ip`/`tc` are missing, carried Debian packages in .debs/ are
# unpacked under /tmp/iproute2 (never into /). Everything goes to OUT_DIR.
source "$(dirname "$0")/device_env.sh"  # $out, $py, "${sp[@]}"; cd to the root
commit=$(git log -1 --format=%h 2>/dev/null || echo unknown)

header() {  # the command, the load, the machine
    echo "# command: $*"
    echo "# load before (date, /proc/loadavg): $(date -u +%FT%TZ) $(cat /proc/loadavg)"
    echo "# host: $(nproc) cores, $(uname -m), $("$py" -c 'import sys, torch; print("Python", sys.version.split()[0], "torch", torch.__version__)'); no calibration file"
    echo "# commit: $commit"
}

{
    uname -r; nproc; command -v ip tc; ip -V
    "$py" -c 'import torch, numba; print("torch", torch.__version__, "numba", numba.__version__)'
} >"$out/env.txt" 2>&1
cat "$out/env.txt"
"$py" -c 'from sparcml.compress.warmup import warm_kernels; warm_kernels()'  # numba's cache, once
"${sp[@]}" cluster --cleanup >/dev/null 2>&1

run() {  # run NAME LIMIT_S ARGS...: one job, its output in OUT_DIR/NAME.txt
    local name=$1 limit=$2
    shift 2
    { header "$@"; timeout "$limit" "$@" 2>&1; echo "# exit $?, $(date -u +%FT%TZ)"; } \
        | grep -v "hostname of the client socket" >"$out/$name.txt"
    tail -n 40 "$out/$name.txt"
    "${sp[@]}" cluster --cleanup >/dev/null 2>&1
}

only=" ${CHECKS:-bench_P8 bench_2x4 floor_P2 floor_P8} "  # a subset: CHECKS="bench_P8 floor_P2"
want() { [[ $only == *" $1 "* ]]; }
bench=(bench --env -N 16M -d 0.00781 --overlap 0 --repeats 5 --interleave)
want bench_P8 && run bench_P8 "${P8_LIMIT_S:-200}" "${sp[@]}" cluster -P 8 --rate 1gbit -- \
    "${sp[@]}" "${bench[@]}" --json "$out/bench_P8.json"
want bench_2x4 && run bench_2x4 "${NODES_LIMIT_S:-180}" "${sp[@]}" cluster --nodes 2 --ranks-per-node 4 \
    --rate 1gbit -- "${sp[@]}" "${bench[@]}" --json "$out/bench_2x4.json"
want floor_P2 && run floor_P2 "${FLOOR_LIMIT_S:-90}" "${sp[@]}" cluster -P 2 --rate 1gbit -- \
    "$py" benchmarks/transport_floor.py -N 16M -d 0.00781 --calls 15
want floor_P8 && run floor_P8 "${FLOOR_LIMIT_S:-90}" "${sp[@]}" cluster -P 8 --rate 1gbit -- \
    "$py" benchmarks/transport_floor.py -N 16M -d 0.00781 --calls 7
exit 0

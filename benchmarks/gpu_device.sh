#!/usr/bin/env bash
# The prepared GPU run on a lent device machine (docs/performance.md, "The prepared GPU
# run"). Two halves:
#
#   bash benchmarks/gpu_device.sh prepare
#       here, where pip reaches the registry: the wheels of what the device's image lacks
#       (benchmarks/gpu_device.txt), for its Python 3.12, into .whl/ (git-ignored);
#   bash benchmarks/gpu_device.sh run [SUITE ARGS]
#       there, as the device tool's run with carry [".whl"]: installs those wheels into
#       /tmp/site, runs `python3 -m benchmarks.gpu_suite` (by default --budget-s 450) and
#       puts what comes back into $OUT: report.json, report.md, study-results.json and
#       gpu-suite.tar.gz (every part's JSON and log; the tool returns at most 8 files).
#
# PYTHON, WHEELS (.whl) and SUITE_DIR (/tmp/gpu-suite) may be set; tests/test_gpu_suite.py
# runs the second half on the CPU with --tiny.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
WHEELS="${WHEELS:-.whl}"

case "${1:-}" in
prepare)
    rm -rf "$WHEELS"
    platforms=()
    for tag in 2_28 2_27 2_24 2_17; do platforms+=(--platform "manylinux_${tag}_x86_64"); done
    platforms+=(--platform manylinux2014_x86_64 --platform manylinux1_x86_64)
    "$PYTHON" -m pip download --quiet --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp "${platforms[@]}" -d "$WHEELS" -r benchmarks/gpu_device.txt
    echo "$(ls "$WHEELS" | wc -l) wheels, $(du -sh "$WHEELS" | cut -f1), in $WHEELS"
    ;;
run)
    shift
    out="${OUT:?set OUT: the folder whose files come back}"
    if [ -d "$WHEELS" ]; then
        "$PYTHON" -m pip install --quiet --no-index --no-deps --no-compile --no-cache-dir \
            --upgrade --target /tmp/site "$WHEELS"/*.whl
        export PYTHONPATH="/tmp/site${PYTHONPATH:+:$PYTHONPATH}"
    fi
    export PYTHONUNBUFFERED=1
    suite="${SUITE_DIR:-/tmp/gpu-suite}"
    if [ $# -eq 0 ]; then set -- --budget-s 450; fi
    status=0
    "$PYTHON" -m benchmarks.gpu_suite --out "$suite" "$@" || status=$?
    # What comes back, whatever the suite's end: the report is rewritten after each part.
    for name in report.json report.md; do
        if [ -f "$suite/$name" ]; then cp "$suite/$name" "$out/"; fi
    done
    if [ -f "$suite/study/results.json" ]; then
        cp "$suite/study/results.json" "$out/study-results.json"
    fi
    # Not the parts' POSBENCH_HOME: checkpoints and caches, hundreds of MB.
    tar -czf "$out/gpu-suite.tar.gz" -C "$suite" --exclude=./home .
    exit "$status"
    ;;
*)
    echo "usage: bash benchmarks/gpu_device.sh prepare | run [gpu_suite arguments]" >&2
    exit 2
    ;;
esac

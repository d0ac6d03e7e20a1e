#!/usr/bin/env bash
# The one device call: GPU test cases, the benchmarks and the soak, on the lent GPU.
#   device run:  bash benchmarks/device_run.sh [--quick] [--tests-only|--bench-only] [--skip-bench]
#                [--sanitize]  (also: the CUDA test cases under compute-sanitizer memcheck)
#                [--exit-check] (also: each test file in its own process, with its exit status)
#                [--gdb=tests/api/test_x.py] (also: that file under cuda-gdb, for a native backtrace)
#                [--ab] (also: benchmarks/diagnostics/primitives_ab.py, this build against the one in
#                .variant/, which benchmarks/diagnostics/make_variant.sh makes; carry .variant)
#                [--serving] (also: benchmarks/bench_torch_serving.py and probe_foreign_await.py)
#                [--profile-loops] (also: benchmarks/diagnostics/profile_loop_throughput.py on
#                every loop, run twice, the loops in both orders, the first with a sweep of the
#                reactor's budget per loop iteration, then on the stand-in clock on this host's
#                CPU: extra.json's "profile_loops", "profile_loops_reversed" and
#                "profile_loops_emulated", the printed profiles in bench.log)
#                [--skip-suite] (the bench step without benchmarks/run.py: graphs, --ab, --serving, soak)
#                [--probe] (also: benchmarks/diagnostics/probe_driver.py: the driver calls' host cost, the
#                layers of a launch, the copy/kernel pipeline by kind of marker; and
#                benchmarks/diagnostics/probe_await.py: where the time of an awaited launch goes;
#                benchmarks/diagnostics/probe_trace.py: where a traced launch's time goes)
# Everything in one call that fits the device tool's 600 s (the test cases, memcheck, the
# benchmarks without their CPU-figure sections, device graphs, the loop profiles):
#   RUN_ARGS=--skip-cpu-loops ASYNCGPU_TEST_HANG_S=60 TEST_TIMEOUT=240 SANITIZE_TIMEOUT=90 \
#     BENCH_TIMEOUT=200 GRAPHS_TIMEOUT=40 bash benchmarks/device_run.sh --sanitize --skip-soak --profile-loops
# and the serving benchmark with the soak in a second call:
#   SOAK_OPS=100000 SOAK_TIMEOUT=60 bash benchmarks/device_run.sh --bench-only --skip-suite --serving
# Writes under $OUT (at most 8 files): env.txt, tests.log (with memcheck's log), tests.json,
# bench.json, bench.log, extra.json (graphs, and the A/B of two builds when .variant/ exists), probe.json (with probe_await's and probe_trace's figures under "await" and "trace"), soak.json, soak.log. Copy them to benchmarks/results/ as DATE-GPU-WHAT-COMMIT.EXT, in place
# of that GPU kind's files there (benchmarks/results/README.md), and commit them.
# The GPU image lacks some test dependencies; carry them as wheels (device tool: carry .whl,
# and asyncgpu/_native.abi3.so built here by `pip install -e .`):
#   ../shared/tools/device-wheels pytest-asyncio==1.5.0 trio==0.32.0 outcome==1.3.0.post0 sniffio==1.3.1 uvloop==0.22.1
set -uo pipefail
OUT=${OUT:-/tmp/asyncgpu-device-out}
mkdir -p "$OUT"
MODE=all QUICK= SKIP_BENCH= SANITIZE= EXIT_CHECK= GDB_FILE= PROBE= SKIP_SOAK= AB= SERVING= SKIP_SUITE=
PROFILE_LOOPS=
for a in "$@"; do
  case "$a" in
    --quick) QUICK=--quick ;;
    --tests-only) MODE=tests ;;
    --bench-only) MODE=bench ;;
    --skip-bench) SKIP_BENCH=1 ;;
    --sanitize) SANITIZE=1 ;;
    --exit-check) EXIT_CHECK=1 ;;
    --gdb=*) GDB_FILE=${a#--gdb=} ;;
    --probe) PROBE=1 ;;
    --skip-soak) SKIP_SOAK=1 ;;
    --ab) AB=1 ;;
    --serving) SERVING=1 ;;
    --skip-suite) SKIP_SUITE=1 ;;
    --profile-loops) PROFILE_LOOPS=1 ;;
  esac
done
if ls .whl/*.whl >/dev/null 2>&1; then
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/site .whl/*.whl || exit 3
  export PYTHONPATH=/tmp/site:$PWD
else
  export PYTHONPATH=$PWD
fi
export PYTHONUNBUFFERED=1 PYTHONFAULTHANDLER=1 ASYNCGPU_CACHE_DIR=/tmp/asyncgpu-kernels
{
  echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
  echo "git: $(git rev-parse HEAD 2>/dev/null || echo unknown) $(git status --porcelain 2>/dev/null | wc -l) uncommitted"
  nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.sm,clocks.mem,temperature.gpu,power.draw --format=csv
  # the host's processor: host-side figures (Python, the driver's host cost) follow it
  echo "cpu: $(grep -m1 '^model name' /proc/cpuinfo | cut -d: -f2- | sed 's/^ *//'), $(nproc) cores usable, load $(cut -d' ' -f1-3 /proc/loadavg)"
  python3 -c 'import sys, numpy, cuda.bindings, cuda.core; print(sys.version); print("numpy", numpy.__version__, "cuda-bindings", cuda.bindings.__version__, "cuda-core", cuda.core.__version__)'
  python3 -m pytest --version
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
rc=0
if [ "$MODE" != bench ]; then
  # --capture=sys keeps fd 2 real, so the suite's hang watchdog (ASYNCGPU_TEST_HANG_S)
  # writes every thread's stack into tests.log before it stops the run.
  PYTHONFAULTHANDLER=1 ASYNCGPU_TEST_HANG_S=${ASYNCGPU_TEST_HANG_S:-60} timeout "${TEST_TIMEOUT:-300}" \
    python3 -m pytest -q -rfEs -p no:cacheprovider --capture=sys tests \
    --junitxml="$OUT/tests.xml" > "$OUT/tests.log" 2>&1
  rc=${PIPESTATUS[0]}
  python3 - "$OUT/tests.xml" "$OUT/tests.json" <<'PY'
import json, sys, xml.etree.ElementTree as ET, datetime, subprocess
try:
    root = ET.parse(sys.argv[1]).getroot()
except Exception as e:
    print("no junit xml:", e); sys.exit(0)
suite = root if root.tag == "testsuite" else root.find("testsuite")
cases = []
for tc in suite.iter("testcase"):
    status = "passed"
    for tag in ("failure", "error", "skipped"):
        el = tc.find(tag)
        if el is not None:
            status = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
            msg = (el.get("message") or "")[:300]
            break
    else:
        msg = ""
    cases.append({"test": f"{tc.get('classname')}::{tc.get('name')}", "status": status,
                  "time_s": float(tc.get("time") or 0), "message": msg})
smi = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version", "--format=csv,noheader"],
                     capture_output=True, text=True).stdout.strip()
summary = {s: sum(c["status"] == s for c in cases) for s in ("passed", "failed", "error", "skipped")}
json.dump({"date": datetime.datetime.now(datetime.timezone.utc).isoformat(), "device": smi,
           "summary": summary, "cases": cases}, open(sys.argv[2], "w"), indent=1)
print("summary:", summary)
PY
  rm -f "$OUT/tests.xml"
  grep -E "passed|failed" "$OUT/tests.log" | tail -3
  grep -E "^(FAILED|ERROR)" "$OUT/tests.log" | head -30
fi
if [ -n "$EXIT_CHECK" ]; then
  # Which test file's process crashes on the way out (a crash at exit hides in the suite's).
  for f in tests/*/test_*.py; do
    timeout 120 python3 -m pytest -q -p no:cacheprovider --capture=sys "$f" > /tmp/exit-check.log 2>&1
    code=$?
    echo "$(basename "$f") exit=$code"
    [ "$code" -gt 1 ] && grep -A12 "Fatal Python" /tmp/exit-check.log | head -14
  done | tee "$OUT/exit-check.txt"
  echo "gdb: $(command -v gdb || echo none)" | tee -a "$OUT/exit-check.txt"
fi
if [ -n "$GDB_FILE" ]; then
  # A native backtrace of a crash (no gdb on the image; cuda-gdb debugs host code too).
  timeout 240 cuda-gdb -q -batch -ex "set pagination off" -ex run -ex "info threads" -ex bt \
    --args python3 -m pytest -v -p no:cacheprovider --capture=sys "$GDB_FILE" \
    > /tmp/gdb.log 2>&1
  echo "cuda-gdb rc=$?" >> /tmp/gdb.log
  { grep -E "PASSED|FAILED|ERROR" /tmp/gdb.log | tail -5; grep -B2 -A60 "received signal" /tmp/gdb.log; tail -5 /tmp/gdb.log; } > "$OUT/gdb.log"
  tail -40 "$OUT/gdb.log"
fi
if [ -n "$SANITIZE" ]; then
  # The CUDA cases under compute-sanitizer's memcheck (use-after-free,
  # out-of-bounds, leaks of device memory), in one process of their own.
  CS=$(command -v compute-sanitizer || ls /usr/local/cuda*/bin/compute-sanitizer 2>/dev/null | head -1)
  if [ -n "$CS" ]; then
    # Leaks are not checked: the pools keep their memory until the process exits.
    timeout "${SANITIZE_TIMEOUT:-240}" "$CS" --tool memcheck --leak-check no --error-exitcode 9 \
      python3 -m pytest -q -p no:cacheprovider -m gpu tests/devices/test_cuda_backend.py \
      tests/api/test_reliability.py -k "${SANITIZE_K:-not ten_thousand and not fault}" \
      > "$OUT/memcheck.log" 2>&1
    echo "memcheck rc=$?" | tee -a "$OUT/memcheck.log"
    grep -E "ERROR SUMMARY|LEAK SUMMARY|passed|failed" "$OUT/memcheck.log" | tail -5
    # The device tool brings back at most 8 files: memcheck's log goes into tests.log.
    { echo; echo "== compute-sanitizer memcheck =="; cat "$OUT/memcheck.log"; } >> "$OUT/tests.log"
    rm -f "$OUT/memcheck.log"
  else
    echo "compute-sanitizer not found on this machine" | tee "$OUT/memcheck.log"
  fi
fi
if [ "$MODE" != tests ]; then
  if [ -f benchmarks/run.py ]; then
    if [ -z "$SKIP_BENCH" ]; then
      # (RUN_ARGS=--skip-cpu-loops leaves out the CPU-figure sections: a call that holds the
      # test cases, memcheck and the benchmarks together then fits the device's 600 s)
      [ -z "$SKIP_SUITE" ] && timeout "${BENCH_TIMEOUT:-330}" python3 benchmarks/run.py --device $QUICK ${RUN_ARGS:-} --json "$OUT/bench.json" > "$OUT/bench.log" 2>&1
      tail -45 "$OUT/bench.log"
      # Device graphs (benchmarks/graphs.py) and, when .variant/ holds another build of the
      # package (benchmarks/diagnostics/make_variant.sh), the A/B of the two builds: their
      # figures go into extra.json under "graphs" and "primitives_ab", their logs into
      # bench.log (the device tool brings back at most 8 files).
      rm -f /tmp/graphs.json /tmp/primitives-ab.json /tmp/torch-serving.json /tmp/probe-foreign.json \
        /tmp/profile-loops.json /tmp/profile-loops-reversed.json /tmp/profile-loops-emulated.json
      { echo; echo "== benchmarks/graphs.py =="; } >> "$OUT/bench.log"
      timeout "${GRAPHS_TIMEOUT:-120}" python3 benchmarks/graphs.py --api cuda --json /tmp/graphs.json \
        >> "$OUT/bench.log" 2>&1
      if [ -n "$AB" ] && [ -d .variant/asyncgpu ]; then
        { echo; echo "== benchmarks/diagnostics/primitives_ab.py =="; } >> "$OUT/bench.log"
        timeout "${AB_TIMEOUT:-150}" python3 benchmarks/diagnostics/primitives_ab.py --variant-dir .variant \
          --json /tmp/primitives-ab.json >> "$OUT/bench.log" 2>&1
      fi
      if [ -n "$SERVING" ]; then
        { echo; echo "== benchmarks/bench_torch_serving.py =="; } >> "$OUT/bench.log"
        timeout "${SERVING_TIMEOUT:-200}" python3 benchmarks/bench_torch_serving.py \
          --json /tmp/torch-serving.json >> "$OUT/bench.log" 2>&1
        { echo; echo "== benchmarks/diagnostics/probe_foreign_await.py =="; } >> "$OUT/bench.log"
        timeout 60 python3 benchmarks/diagnostics/probe_foreign_await.py --target cuda \
          --json /tmp/probe-foreign.json >> "$OUT/bench.log" 2>&1
      fi
      if [ -n "$PROFILE_LOOPS" ]; then
        # Both orders: a loop measured after the others in one process would show
        # whatever they left behind (threads, the collector's heap) as its own cost.
        for order in asyncio,uvloop,trio trio,uvloop,asyncio; do
          dest=/tmp/profile-loops.json; [ "$order" = trio,uvloop,asyncio ] && dest=/tmp/profile-loops-reversed.json
          { echo; echo "== benchmarks/diagnostics/profile_loop_throughput.py --loops $order =="; } >> "$OUT/bench.log"
          # (the first order also compares the reactor's budget per loop iteration)
          sweep=--budget-sweep=0.2,0.4; [ "$order" = trio,uvloop,asyncio ] && sweep=
          timeout "${PROFILE_TIMEOUT:-90}" python3 benchmarks/diagnostics/profile_loop_throughput.py \
            --target cuda --loops "$order" --top 20 $sweep --json "$dest" >> "$OUT/bench.log" 2>&1
        done
        # The same on the stand-in clock, on this host's CPU: whether a loop's cost
        # here is the GPU's or the host's (trio's stand-in figures differ by host).
        { echo; echo "== benchmarks/diagnostics/profile_loop_throughput.py --target emulated =="; } >> "$OUT/bench.log"
        timeout 60 python3 benchmarks/diagnostics/profile_loop_throughput.py --target emulated \
          --stand-in-op-us 2 --stand-in-latency-us 6 --top 20 --json /tmp/profile-loops-emulated.json \
          >> "$OUT/bench.log" 2>&1
        grep -E "^== (asyncio|uvloop|trio):" "$OUT/bench.log" | cut -c1-160
      fi
      python3 - "$OUT/extra.json" graphs=/tmp/graphs.json primitives_ab=/tmp/primitives-ab.json \
        torch_serving=/tmp/torch-serving.json probe_foreign_await=/tmp/probe-foreign.json \
        profile_loops=/tmp/profile-loops.json profile_loops_reversed=/tmp/profile-loops-reversed.json \
        profile_loops_emulated=/tmp/profile-loops-emulated.json <<'PY'
import json, os, sys
extra = {}
for arg in sys.argv[2:]:
    key, path = arg.split("=", 1)
    if os.path.exists(path):
        extra[key] = json.load(open(path))
json.dump(extra, open(sys.argv[1], "w"), indent=1)
PY
      sed -n '/== benchmarks\/graphs.py ==/,$p' "$OUT/bench.log" | tail -40
    fi
    if [ -n "$PROBE" ]; then
      timeout 120 python3 benchmarks/diagnostics/probe_driver.py --json "$OUT/probe.json" 2>&1 | tail -20
      # The device tool brings back at most 8 files: probe_await's figures go into
      # probe.json under the key "await".
      timeout 60 python3 benchmarks/diagnostics/probe_await.py --json /tmp/probe-await.json 2>&1 | tail -14
      timeout 60 python3 benchmarks/diagnostics/probe_trace.py --json /tmp/probe-trace.json 2>&1 | tail -16
      python3 - "$OUT/probe.json" /tmp/probe-await.json /tmp/probe-trace.json <<'PY'
import json, sys
probe = json.load(open(sys.argv[1])) if __import__("os").path.exists(sys.argv[1]) else {}
for key, path in (("await", sys.argv[2]), ("trace", sys.argv[3])):
    try:
        probe[key] = json.load(open(path))
    except OSError as e:
        probe[key] = {"error": str(e)}
json.dump(probe, open(sys.argv[1], "w"), indent=1)
PY
    fi
    if [ -z "$SKIP_SOAK" ]; then
      ops=${SOAK_OPS:-1000000}; [ -n "$QUICK" ] && ops=100000
      timeout "${SOAK_TIMEOUT:-240}" python3 benchmarks/soak.py --device cuda --ops $ops --tasks 1000 \
        --streams 8 --json "$OUT/soak.json" > "$OUT/soak.log" 2>&1
      tail -15 "$OUT/soak.log"
    fi
  else
    timeout 300 python3 benchmarks/bench_engine.py $QUICK --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.log"
    timeout 200 python3 benchmarks/peers_gpu.py --quick --json "$OUT/peers.json" 2>&1 | tail -60 | tee "$OUT/peers.log"
  fi
fi
exit $rc

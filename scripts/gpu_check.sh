#!/usr/bin/env bash
# gpu_check.sh — the one prepared script for a GPU machine (torch with CUDA, nvcc, no internet).
# Steps, in this order, each under its own time limit drawn from one budget so that one hang
# cannot eat the rest (GPU_CHECK_BUDGET_S, default 530 s: the whole run ends inside 10 minutes):
#
#   gpu           a GPU visible to torch; without one the script stops here, exit 2, in seconds
#   build         python setup.py build_ext --inplace, CKPT_EXT_CUDA=1 (no silent CPU fallback),
#                 for the visible GPU's architecture only (TORCH_CUDA_ARCH_LIST overrides), nproc jobs
#   tests         pytest -m cuda tests: every CUDA test of the suite (GPU_CHECK_TESTS overrides)
#   memcheck      compute-sanitizer --tool memcheck on scripts/gpu_sanitize_case.py (every kernel
#                 path, small), caching allocator off so an overrun is caught
#   kernel_bench  scripts/gpu_kernel_bench.py: each elementwise kernel's GB/s vs a D2D copy
#   timing        scripts/gpu_timing.py: fused ops vs nn.Sequential and torch.utils.checkpoint
#   bench_eager   python -m ckpt_ext.bench --device cuda (the write-up's sizes), every default mode
#                 that does not compile, on every network
#   bench_compile python -m ckpt_ext.bench --device cuda --networks chain: the default modes that
#                 torch.compile (with plain), on the write-up's own network; late, as compiling is
#                 the slowest and least predictable step, with all the time left but 50 s
#   racecheck     compute-sanitizer --tool racecheck on the shared-memory combine passes
#
# Into $OUT (else bench_out/gpu_check/), at most 5 files: gpu_check.log (this script's log with
# the tail of every step's log folded in), gpu_check.json (device, versions, each step's result
# and seconds, test counts and failures, the kernel bandwidths with the targets, the timings, the
# benchmark's headline figures), and the benchmark's own cuda-writeup.json under bench_eager/ and
# bench_compile/ (+ the eager run's .png where matplotlib is installed). Exit status 0 only when
# every step passed; a pass/fail line per step ends the log.
#
#   bash scripts/gpu_check.sh
#   PYTHON=python3 GPU_CHECK_BUDGET_S=300 bash scripts/gpu_check.sh
#   GPU_CHECK_DRY_RUN=1 GPU_CHECK_SKIP_BUILD=1 bash scripts/gpu_check.sh   # no GPU: run every step
#       anyway (each GPU step then fails fast), to check this script itself
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-530}
RESERVE=15   # seconds kept for the summary
DEST=${OUT:-bench_out/gpu_check}
mkdir -p "$DEST"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$DEST/gpu_check.log"
: >"$LOG"
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
say() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - RESERVE - ($(date +%s) - START))); }

declare -A RC SECS
ORDER=()
# step NAME CAP_S CMD...: runs CMD under min(CAP_S, budget left), output to $TMP/NAME.log; records
# its exit status (124/137: killed at the time limit) and seconds.
step() {
  local name=$1 cap=$2; shift 2
  ORDER+=("$name")
  local t; t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 10 ]; then
    say "$name: skipped, the budget is spent"; RC[$name]=skipped; SECS[$name]=0; return
  fi
  say "$name: start (limit ${t}s)"
  local s; s=$(date +%s)
  timeout --kill-after=10 "$t" "$@" >"$TMP/$name.log" 2>&1
  local rc=$?
  RC[$name]=$rc; SECS[$name]=$(($(date +%s) - s))
  say "$name: rc=$rc in ${SECS[$name]}s"
}
# skip NAME WHY: a step that cannot run.
skip() { ORDER+=("$1"); RC[$1]="skipped"; SECS[$1]=0; say "$1: skipped, $2"; }
# fold NAME LINES: the last LINES lines of a step's log into gpu_check.log.
fold() {
  [ -f "$TMP/$1.log" ] || return 0
  { echo "===== $1 (last $2 lines of its log)"; tail -n "$2" "$TMP/$1.log"; } >>"$LOG"
}

# ---- gpu
say "python: $PY; dest: $DEST; budget ${BUDGET}s"
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm,clocks.max.memory \
  --format=csv,noheader 2>&1 | head -n 4 | tee -a "$LOG"
nvcc --version 2>&1 | grep release | tee -a "$LOG"
CC=$("$PY" -c "import torch; c = torch.cuda.get_device_capability(0) if torch.cuda.is_available() else None; print(f'{c[0]}.{c[1]}' if c else 'none')" 2>>"$LOG")
ORDER+=(gpu); SECS[gpu]=0
if [ -z "$CC" ] || [ "$CC" = none ]; then
  RC[gpu]=no-gpu
  say "FAIL: no GPU visible to torch (torch.cuda.is_available() is False, or torch did not import)."
  say "      This script needs the GPU machine; every CUDA test would only skip here."
  if [ "${GPU_CHECK_DRY_RUN:-0}" != 1 ]; then
    "$PY" -c "import json,sys; json.dump({'steps': {'gpu': {'rc': 'no-gpu', 'seconds': 0}}, 'ok': False}, open(sys.argv[1], 'w'), indent=1)" \
      "$DEST/gpu_check.json" 2>/dev/null
    exit 2
  fi
  say "GPU_CHECK_DRY_RUN=1: running every step anyway; the GPU steps will fail fast"
  CC=9.0
else
  RC[gpu]=0
fi
ARCH=${TORCH_CUDA_ARCH_LIST:-$CC}

# ---- build
if [ "${GPU_CHECK_SKIP_BUILD:-0}" = 1 ]; then
  skip build "GPU_CHECK_SKIP_BUILD=1: using the module already built"
else
  rm -f ckpt_ext/_C*.so
  step build 300 env CKPT_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
    "$PY" setup.py build_ext --inplace
  grep '^ckpt_ext setup:' "$TMP/build.log" | tee -a "$LOG"
  fold build 15
fi
BUILT=$("$PY" -c "import ckpt_ext; print(int(ckpt_ext.WITH_CUDA))" 2>>"$LOG")
if [ "$BUILT" != 1 ]; then
  say "FAIL: ckpt_ext does not import with its CUDA kernels (WITH_CUDA=${BUILT:-import failed}); the GPU steps are skipped"
  for s in tests memcheck kernel_bench timing bench_eager racecheck bench_compile; do
    skip "$s" "no CUDA build"
  done
else
  # ---- tests: every test with the cuda marker (tests/test_ops_cuda.py and the CUDA cases of the
  # device-parametrized files); a collection error in one file does not stop the others
  step tests 150 env CKPT_EXT_EXPECT_CUDA=1 "$PY" -m pytest -q -rfE --tb=short -p no:cacheprovider \
    --continue-on-collection-errors --junitxml="$TMP/junit.xml" ${GPU_CHECK_TESTS:--m cuda tests}
  fold tests 120

  # ---- compute-sanitizer
  SAN=$(command -v compute-sanitizer || true)
  if [ -z "$SAN" ]; then
    TOP=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
    for c in "${CUDA_HOME:-}" "$TOP" /usr/local/cuda; do
      [ -n "$c" ] && [ -x "$c/bin/compute-sanitizer" ] && { SAN="$c/bin/compute-sanitizer"; break; }
    done
  fi
  if [ -n "$SAN" ]; then
    step memcheck 120 env PYTORCH_NO_CUDA_MEMORY_CACHING=1 "$SAN" --tool memcheck \
      --error-exitcode 3 --print-limit 20 "$PY" scripts/gpu_sanitize_case.py
    fold memcheck 30
  else
    skip memcheck "compute-sanitizer not found"; RC[memcheck]=absent
  fi

  # ---- the kernels' bandwidth, the ops' timings
  step kernel_bench 90 "$PY" scripts/gpu_kernel_bench.py --json "$TMP/kernel_bench.json"
  fold kernel_bench 40
  step timing 75 "$PY" scripts/gpu_timing.py --json "$TMP/timing.json"
  fold timing 40

  # ---- the benchmark at the write-up's sizes (its CUDA default): the default modes, split into
  # those that compile and those that do not (names from ckpt_ext.bench itself)
  if [ -n "${CKPT_EXT_BENCH_ARGS:-}" ]; then
    step bench_eager 300 "$PY" -m ckpt_ext.bench --device cuda --out "$DEST/bench_eager" \
      $CKPT_EXT_BENCH_ARGS
    fold bench_eager 60
  else
    MODES=$("$PY" -c "from ckpt_ext.bench import build_parser; print(build_parser().get_default('modes'))" 2>>"$LOG")
    EAGER=$(echo "$MODES" | tr ',' '\n' | grep -v compile | paste -sd, -)
    COMPILED=$(echo "$MODES" | tr ',' '\n' | grep compile | paste -sd, -)
    say "bench modes: eager ${EAGER:-?}; compiled ${COMPILED:-?}"
    if [ -n "$EAGER" ]; then
      step bench_eager 150 "$PY" -m ckpt_ext.bench --device cuda --modes "$EAGER" \
        --out "$DEST/bench_eager"
    else
      step bench_eager 300 "$PY" -m ckpt_ext.bench --device cuda --out "$DEST/bench_eager"
    fi
    fold bench_eager 60
  fi

  # compiling is the slowest and least predictable step: it gets what is left but 50 s, so that
  # racecheck still runs after it
  if [ -z "${CKPT_EXT_BENCH_ARGS:-}" ] && [ -n "${COMPILED:-}" ]; then
    step bench_compile $(($(left) - 50)) "$PY" -m ckpt_ext.bench --device cuda --networks chain \
      --modes "plain,$COMPILED" --out "$DEST/bench_compile"
    fold bench_compile 40
  fi

  if [ -n "$SAN" ]; then
    step racecheck 45 "$SAN" --tool racecheck --error-exitcode 3 --print-limit 20 \
      "$PY" scripts/gpu_sanitize_case.py --only combine
    fold racecheck 20
  else
    skip racecheck "compute-sanitizer not found"; RC[racecheck]=absent
  fi
fi
rm -f "$DEST"/bench_*/*.md "$DEST"/bench_compile/*.png  # the tables are in the log

# ---- summary
steps=""; for k in "${ORDER[@]}"; do steps+="$k=${RC[$k]}:${SECS[$k]} "; done
"$PY" - "$DEST" "$TMP" "$steps" "${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}" <<'EOF' 2>&1 | tee -a "$LOG"
import glob, json, os, subprocess, sys, xml.etree.ElementTree as ET
dest, tmp, steps, commit = sys.argv[1:5]
res = {"commit": commit, "steps": {}}
for kv in steps.split():
    k, v = kv.split("=", 1)
    rc, secs = v.rsplit(":", 1)
    res["steps"][k] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(secs)}
try:
    import torch
    res["torch"], res["cuda"] = torch.__version__, torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        res["device"], res["capability"] = torch.cuda.get_device_name(0), f"{p.major}.{p.minor}"
        res["memory_GiB"] = round(p.total_memory / 2**30, 1)
except Exception as e:  # the summary must still be written
    res["torch_error"] = repr(e)
try:
    res["nvcc"] = [l for l in subprocess.run(["nvcc", "--version"], capture_output=True,
                                             text=True).stdout.splitlines() if "release" in l][0]
    res["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip()
except Exception as e:
    res["tool_error"] = repr(e)
notes = {}
junit = os.path.join(tmp, "junit.xml")
if os.path.exists(junit) and os.path.getsize(junit):
    root = ET.parse(junit).getroot()
    suites = [root] if root.tag == "testsuite" else list(root.iter("testsuite"))
    t = {k: sum(int(s.get(k, 0)) for s in suites) for k in ("tests", "failures", "errors", "skipped")}
    cases = [c for s in suites for c in s.iter("testcase")]
    t["failed_ids"] = [f"{c.get('classname')}::{c.get('name')}" for c in cases
                       if c.find("failure") is not None or c.find("error") is not None][:50]
    t["skip_reasons"] = sorted({(c.find("skipped").get("message") or "")[:120]
                                for c in cases if c.find("skipped") is not None})[:20]
    res["tests"] = t
    notes["tests"] = (f"{t['tests'] - t['failures'] - t['errors'] - t['skipped']} passed, "
                      f"{t['failures']} failed, {t['errors']} errors, {t['skipped']} skipped")
for name in ("kernel_bench", "timing"):
    path = os.path.join(tmp, f"{name}.json")
    if os.path.exists(path):
        res[name] = json.load(open(path))
if "kernel_bench" in res:
    tg = res["kernel_bench"].get("targets", {})
    notes["kernel_bench"] = (f"targets met {sum(v['met'] for v in tg.values())}/{len(tg)}; "
                             "worst " + ", ".join(f"{k} {100 * v['worst_frac']:.0f}%"
                                                  for k, v in tg.items() if not v["met"])[:200])
benches = {}
for path in sorted(glob.glob(os.path.join(dest, "bench_*", "*.json"))):
    run = os.path.basename(os.path.dirname(path))
    try:
        b = json.load(open(path))
    except Exception as e:
        benches[run] = {"error": repr(e)}
        continue
    head = {"file": os.path.relpath(path, dest), "conditions": b.get("conditions")}
    for net, modes in b.get("networks", {}).items():
        head[net] = {m: {k: r.get(k) for k in ("step_ms", "time_vs_plain", "kept_for_backward",
                                              "peak_above_before_forward", "grad_rel_err", "error")
                         if k in r} for m, r in modes.items()}
    benches[run] = head
if benches:
    res["bench"] = benches
    chain = benches.get("bench_eager", {}).get("chain", {})
    if "fused" in chain and "checkpoint" in chain and chain["checkpoint"].get("step_ms"):
        r = chain["fused"].get("step_ms", float("nan")) / chain["checkpoint"]["step_ms"]
        res["fused_vs_checkpoint_chain"] = r
        notes["bench_eager"] = f"chain: fused step / checkpoint step = {r:.2f} (target <= 1)"
ok_rc = lambda rc: rc == 0 or rc == "absent"
res["ok"] = all(ok_rc(s["rc"]) for s in res["steps"].values())
json.dump(res, open(os.path.join(dest, "gpu_check.json"), "w"), indent=1)
print(f"\n{'step':<14} {'result':<10} {'seconds':>7}  note")
for k, s in res["steps"].items():
    rc = s["rc"]
    word = ("ok" if rc == 0 else "absent" if rc == "absent" else "TIMEOUT" if rc in (124, 137)
            else "skipped" if rc == "skipped" else "no GPU" if rc == "no-gpu" else f"FAIL({rc})")
    note = {"gpu": res.get("device", ""), **notes}.get(k, "")
    print(f"{k:<14} {word:<10} {s['seconds']:>7}  {note}")
print(f"overall: {'PASS' if res['ok'] else 'FAIL'}")
EOF
say "done in $(($(date +%s) - START))s; files in $DEST: $(cd "$DEST" && find . -type f | sort | tr '\n' ' ')"
"$PY" -c "import json,sys; sys.exit(0 if json.load(open(sys.argv[1])).get('ok') else 1)" "$DEST/gpu_check.json"

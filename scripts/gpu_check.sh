#!/usr/bin/env bash
# gpu_check.sh — the one prepared run for a GPU machine (torch with CUDA, nvcc, no internet), in
# tiers, most important first, every step under a fixed cap. The caps of the required steps and
# of the summary add up to the total cap: the run's budget and its hard wall (docs/gpu_check.md).
#
#   bash scripts/gpu_check.sh --plan          # each step with its cap; ends "total cap: N s"
#   bash scripts/gpu_check.sh                 # the run; into $OUT (else bench_out/gpu_check)
#   PYTHON=python3 bash scripts/gpu_check.sh  # the interpreter (default .venv/bin/python, python3)
#   GPU_CHECK_DRY_RUN=1 bash scripts/gpu_check.sh   # rehearsal without a GPU: every step runs
#       a cheap form of its command (setup.py's configuration, tests without a GPU, the scripts'
#       --list/--dry-run, the benchmark on CPU at the tiny preset), under the same caps
#
# Exit status: 0 when nothing failed: "overall: PASS", or "overall: CUT" when a step with tests or
# cases was stopped by its cap with none failed (its note counts passed / failed / not run); steps
# not run are listed, never failed. 1 when a step failed or hit its cap with a failure (or, for a
# step without tests, hit its cap at all); 2 when no GPU is visible (not a dry run): stopped at once.
set -uo pipefail
cd "$(dirname "$0")/.."

# ---- the plan -----------------------------------------------------------------------------------
# name cap tier what. Required steps run in this order, each within its cap; the summary's cap
# closes the budget. The tests step may also use what the steps before it left unused (it ends by
# the sum of the caps up to its own), which leaves every later step its whole cap. Each cap's
# grounds: docs/gpu_check.md, "Budget".
TEST_TIMEOUT=45  # seconds per test (pytest-timeout), within the tests step's cap
# The tests: every `cuda`-marked test, from the files that hold one (scripts/gpu_check_pytest.py
# finds them without importing the others), ordered by value: a cover of every test function's
# dtypes, activations and layouts first (these files' functions first), the long sweeps last.
TESTS_FIRST="tests/ops/test_ops_cuda.py tests/ops"
REQUIRED=(
  "probe 25 1 GPU visible to torch; driver, nvcc, torch, compute-sanitizer, pytest-timeout"
  "build 140 1 setup.py build_ext --inplace, CKPT_EXT_CUDA=1, the visible GPU's arch, nproc jobs"
  "import 20 1 import ckpt_ext with its CUDA kernels; one fused op forward+backward on the GPU"
  "tests 105 2 pytest -m cuda by value, ${TEST_TIMEOUT} s a test, results kept as they end; + tier 1's spare"
  "memcheck 80 3 compute-sanitizer memcheck on gpu_sanitize_case.py: every kernel path, every activation"
  "kernel_bench 45 4 gpu_kernel_bench.py: GB/s vs a D2D copy; tanh primitives, every activation's kernels"
  "bench_eager 45 5 python -m ckpt_ext.bench --device cuda --networks chain, eager modes"
)
SUMMARY_CAP=10
# name minimum-to-start max-cap what. Run in this order after the required steps, each only
# when the total cap still leaves it its minimum; each ends before the summary's reserve.
OPTIONAL=(
  "racecheck 40 45 compute-sanitizer racecheck on the bias sums' combine (shared memory)"
  "bench_plan 60 150 python -m ckpt_ext.bench --section plan, bfloat16, eager methods: plan vs transformers' checkpointing"
  "timing 35 45 gpu_timing.py: FusedLinearTanh/FusedTanhMLP vs Sequential and checkpoint"
  "bench_compile 120 600 python -m ckpt_ext.bench --networks chain, the torch.compile modes"
)
TOTAL=$SUMMARY_CAP
for s in "${REQUIRED[@]}"; do read -r _ c _ <<<"$s"; TOTAL=$((TOTAL + c)); done

print_plan() {
  printf '%-14s %6s %5s  %s\n' step cap_s tier what
  for s in "${REQUIRED[@]}"; do
    read -r name cap tier what <<<"$s"
    printf '%-14s %6s %5s  %s\n' "$name" "$cap" "$tier" "$what"
  done
  printf '%-14s %6s %5s  %s\n' summary "$SUMMARY_CAP" - "gpu_check.json and the result table"
  echo "optional, in this order, only with time to spare (what the steps above leave unused):"
  for s in "${OPTIONAL[@]}"; do
    read -r name min cap what <<<"$s"
    printf '  %-12s starts with >= %s s left, runs <= %s s: %s\n' "$name" "$min" "$cap" "$what"
  done
  echo "total cap: $TOTAL s"
}
if [ "${1:-}" = --plan ]; then print_plan; exit 0; fi
if [ $# -gt 0 ]; then echo "usage: bash scripts/gpu_check.sh [--plan]" >&2; exit 64; fi

# ---- set-up -------------------------------------------------------------------------------------
START=$(date +%s)
DRY=${GPU_CHECK_DRY_RUN:-0}
DEST=${OUT:-bench_out/gpu_check}
mkdir -p "$DEST"
rm -rf "$DEST/gpu_check.log" "$DEST/gpu_check.json" "$DEST/bench_eager" "$DEST/bench_compile" \
  "$DEST/bench_plan"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
export PYTHONPATH="$PWD:$TMP${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$DEST/gpu_check.log"
: >"$LOG"
elapsed() { echo $(($(date +%s) - START)); }
say() { echo "[gpu_check $(elapsed)s] $*" | tee -a "$LOG"; }

declare -A RESULT SECS CAPS NOTE STARTS
ORDER=()
# run_step NAME CAP CMD...: CMD under CAP seconds in all (SIGTERM at CAP-5 s, SIGKILL 5 s later),
# output to $TMP/NAME.log. Result: pass, fail(rc) or timeout.
run_step() {
  local name=$1 cap=$2; shift 2
  ORDER+=("$name"); CAPS[$name]=$cap
  say "$name: start (cap ${cap}s)"
  local s t=$((cap - 5)); s=$(date +%s)
  STARTS[$name]=$s
  [ "$t" -lt 1 ] && t=1
  timeout --kill-after=5 "$t" "$@" >"$TMP/$name.log" 2>&1
  local rc=$?
  SECS[$name]=$(($(date +%s) - s))
  case $rc in
    0) RESULT[$name]=pass ;;
    124|137) RESULT[$name]=timeout ;;
    *) RESULT[$name]="fail($rc)" ;;
  esac
  say "$name: ${RESULT[$name]} in ${SECS[$name]}s"
}
# not_run NAME WHY; failed NAME WHY: a step that could not start, and why
not_run() { ORDER+=("$1"); RESULT[$1]="not run"; SECS[$1]=0; NOTE[$1]=$2; say "$1: not run, $2"; }
failed() { ORDER+=("$1"); RESULT[$1]="fail"; SECS[$1]=0; NOTE[$1]=$2; say "$1: FAIL, $2"; }
# fold NAME LINES: the last LINES lines of a step's log into gpu_check.log
fold() {
  [ -s "$TMP/$1.log" ] || return 0
  { echo "===== $1 (last $2 lines of its log)"; tail -n "$2" "$TMP/$1.log"; } >>"$LOG"
}
# cap NAME: a required step's cap; caps_through NAME: the caps of the steps up to NAME, summed
cap() {
  local s n c
  for s in "${REQUIRED[@]}"; do read -r n c _ <<<"$s"; [ "$n" = "$1" ] && echo "$c"; done
}
caps_through() {
  local s n c t=0
  for s in "${REQUIRED[@]}"; do read -r n c _ <<<"$s"; t=$((t + c)); [ "$n" = "$1" ] && break; done
  echo "$t"
}
say "python: $PY; dest: $DEST; total cap ${TOTAL}s; dry run: $DRY"

# ---- tier 1: probe, build, import ---------------------------------------------------------------
cat >"$TMP/probe.py" <<'EOF'
"""Facts of this machine into probe.json; exit 3 without a GPU visible to torch."""
import importlib.util, json, shutil, subprocess, sys
out = {"python": sys.version.split()[0]}
def run(cmd):
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=5).stdout.strip()
    except Exception as e:  # noqa: BLE001 - recorded
        return f"unavailable ({type(e).__name__})"
out["nvidia_smi"] = run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total",
                         "--format=csv,noheader"])
out["nvcc"] = next((l for l in run(["nvcc", "--version"]).splitlines() if "release" in l), None)
out["nproc"] = run(["nproc"])
out["compute_sanitizer"] = shutil.which("compute-sanitizer")
out["pytest_timeout"] = importlib.util.find_spec("pytest_timeout") is not None
import torch
out["torch"], out["cuda"] = torch.__version__, torch.version.cuda
out["gpu"] = torch.cuda.is_available()
if out["gpu"]:
    p = torch.cuda.get_device_properties(0)
    out.update(device=p.name, capability=f"{p.major}.{p.minor}",
               memory_GiB=round(p.total_memory / 2**30, 1), sm_count=p.multi_processor_count)
json.dump(out, open(sys.argv[1], "w"), indent=1)
print(json.dumps(out, indent=1))
sys.exit(0 if out["gpu"] else 3)
EOF
run_step probe "$(cap probe)" "$PY" "$TMP/probe.py" "$TMP/probe.json"
fold probe 25
pyget() { "$PY" -c "import json,sys; print(json.load(open(sys.argv[1])).get(sys.argv[2]) or '')" \
  "$TMP/probe.json" "$1" 2>/dev/null; }
CC=$(pyget capability)
if [ "${RESULT[probe]}" != pass ]; then
  if [ "$DRY" != 1 ]; then
    say "probe ${RESULT[probe]}: no GPU visible to torch, or torch did not import (the probe's" \
        "log is in $LOG); this run needs the GPU machine: stop"
    "$PY" -c "import json, sys; json.dump({'ok': False, 'steps': {'probe': 'no GPU'}},
      open(sys.argv[1], 'w'))" "$DEST/gpu_check.json" 2>/dev/null
    exit 2
  fi
  say "GPU_CHECK_DRY_RUN=1: no GPU; the probe counts as rehearsed, each GPU step runs its dry form"
  RESULT[probe]=pass; NOTE[probe]="dry run: no GPU, arch 9.0 assumed"
  CC=9.0
else
  NOTE[probe]="$(pyget device), sm $CC, $(pyget nproc) cores"
fi
ARCH=${TORCH_CUDA_ARCH_LIST:-$CC}
SAN=$(pyget compute_sanitizer)
if [ -z "$SAN" ]; then
  TOP=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
  for c in "${CUDA_HOME:-}" "$TOP" /usr/local/cuda; do
    [ -n "$c" ] && [ -x "$c/bin/compute-sanitizer" ] && { SAN="$c/bin/compute-sanitizer"; break; }
  done
fi

BUILD_ENV=(env CKPT_EXT_CUDA=1 TORCH_CUDA_ARCH_LIST="$ARCH" MAX_JOBS="${MAX_JOBS:-$(nproc)}")
if [ "$DRY" = 1 ]; then
  # setup.py's configuration (toolkit, arch list, sources) without compiling
  run_step build "$(cap build)" "${BUILD_ENV[@]}" "$PY" setup.py build_ext --help
else
  rm -f ckpt_ext/_C*.so
  run_step build "$(cap build)" "${BUILD_ENV[@]}" "$PY" setup.py build_ext --inplace
fi
grep '^ckpt_ext setup:' "$TMP/build.log" | tee -a "$LOG"
fold build 12
# each object's compile time from ninja's logs of this build: the figures behind the build's cap
find build -name .ninja_log -newer "$TMP/probe.json" 2>/dev/null | while read -r f; do
  awk '!/^#/ { printf "%7.1f s  %s\n", ($2 - $1) / 1000, $4 }' "$f"
done | sort -rn | head -n 12 | sed 's/^/build: compile /' | tee -a "$LOG"

cat >"$TMP/import_check.py" <<'EOF'
"""ckpt_ext imports with its CUDA kernels; one fused op runs forward and backward on the GPU.
Writes the benchmark's eager and compiled mode lists for the later steps."""
import sys
import torch
import ckpt_ext
from ckpt_ext.bench import DEFAULT_MODES, MODES
print(f"ckpt_ext: WITH_CUDA={ckpt_ext.WITH_CUDA}, CUDA_ARCH_LIST={ckpt_ext._C.CUDA_ARCH_LIST!r}, "
      f"built with torch {ckpt_ext._C.TORCH_BUILD_VERSION}")
with open(sys.argv[1], "w") as f:
    f.write(",".join(m for m in DEFAULT_MODES if not MODES[m].compiled) + "\n")
    f.write(",".join(m for m in DEFAULT_MODES if MODES[m].compiled) + "\n")
if not ckpt_ext.WITH_CUDA:
    sys.exit("ckpt_ext was built without its CUDA kernels")
if torch.cuda.is_available():
    x = torch.randn(8, 16, device="cuda", requires_grad=True)
    m = ckpt_ext.FusedLinearTanh(16, 32).cuda()
    ref = torch.tanh(torch.nn.functional.linear(x, m.weight, m.bias))
    y = m(x)
    y.sum().backward()
    torch.cuda.synchronize()
    err = (y - ref).abs().max().item()
    print(f"FusedLinearTanh on {torch.cuda.get_device_name(0)}: max |y - ref| = {err:.2e}")
    assert err < 1e-3 and torch.isfinite(x.grad).all()
EOF
if [ "${RESULT[build]}" = pass ]; then
  run_step import "$(cap import)" "$PY" "$TMP/import_check.py" "$TMP/modes"
  fold import 10
else
  not_run import "the build did not pass"
fi
EAGER=$(sed -n 1p "$TMP/modes" 2>/dev/null)
COMPILED=$(sed -n 2p "$TMP/modes" 2>/dev/null)

if [ "${RESULT[import]}" != pass ]; then
  for s in tests memcheck kernel_bench bench_eager racecheck timing bench_compile; do
    not_run "$s" "no CUDA build of ckpt_ext imported"
  done
else
  # ---- tier 2: the CUDA tests, by value (scripts/gpu_check_pytest.py), results kept as they end -
  TEST_ARGS=(-q -rfE --tb=short -p no:cacheprovider -p gpu_check_pytest
             --continue-on-collection-errors)
  if [ "$(pyget pytest_timeout)" = True ]; then
    TEST_ARGS+=(--timeout="$TEST_TIMEOUT" --timeout-method=signal)
  else
    say "tests: pytest-timeout is not installed: the step's cap is the only limit"
  fi
  # GPU_CHECK_TESTS replaces the selection, e.g. "tests/ops/test_ops_cuda.py -k graphs"
  read -r -a SEL <<<"${GPU_CHECK_TESTS:--m cuda $("$PY" scripts/gpu_check_pytest.py tests | tr '\n' ' ')}"
  run_step tests $(($(caps_through tests) - $(elapsed))) \
    env PYTHONPATH="$PWD/scripts:$PYTHONPATH" GPU_CHECK_TESTS_JSONL="$TMP/tests.jsonl" \
    GPU_CHECK_TESTS_ORDER="$TMP/tests_order.txt" GPU_CHECK_TESTS_FIRST="$TESTS_FIRST" \
    CKPT_EXT_EXPECT_CUDA=1 "$PY" -m pytest "${TEST_ARGS[@]}" "${SEL[@]}"
  fold tests 60

  # ---- tier 3: memcheck ---------------------------------------------------------------------------
  # The case stops itself 10 s before the cap (--deadline, wall clock: it cannot see how long the
  # sanitizer took to start it) and records each case's seconds, and its own start, in a JSON.
  SAN_ARGS=(--report-api-errors no --error-exitcode 3 --print-limit 20)
  CASE=(scripts/gpu_sanitize_case.py)
  [ "$DRY" = 1 ] && CASE+=(--list)
  deadline() { echo $(($(date +%s) + $1 - 10)); }
  if [ -n "$SAN" ]; then
    run_step memcheck "$(cap memcheck)" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
      "$SAN" --tool memcheck "${SAN_ARGS[@]}" "$PY" "${CASE[@]}" \
      --json "$TMP/memcheck.json" --deadline "$(deadline "$(cap memcheck)")"
  elif [ "$DRY" = 1 ]; then
    say "memcheck: compute-sanitizer not found here; the case's --list alone"
    run_step memcheck "$(cap memcheck)" "$PY" "${CASE[@]}" --json "$TMP/memcheck.json"
  else
    failed memcheck "compute-sanitizer not found (PATH, CUDA_HOME, nvcc's toolkit)"
  fi
  fold memcheck 30

  # ---- tier 4: bandwidth ------------------------------------------------------------------------
  KB=(scripts/gpu_kernel_bench.py --json "$TMP/kernel_bench.json" --log2-sizes 20,24,27
      --samples 5 --max-seconds $(($(cap kernel_bench) - 15)))
  [ "$DRY" = 1 ] && KB+=(--dry-run)
  run_step kernel_bench "$(cap kernel_bench)" "$PY" "${KB[@]}"
  fold kernel_bench 30

  # ---- tier 5: fused vs checkpoint at the write-up's sizes --------------------------------------
  BENCH=(-m ckpt_ext.bench --device cuda --networks chain --no-progress)
  [ "$DRY" = 1 ] && BENCH=(-m ckpt_ext.bench --device cpu --preset tiny --networks chain
                           --no-progress)
  run_step bench_eager "$(cap bench_eager)" "$PY" "${BENCH[@]}" --modes "$EAGER" \
    --out "$DEST/bench_eager"
  fold bench_eager 40

  # ---- optional, with time to spare -------------------------------------------------------------
  for s in "${OPTIONAL[@]}"; do
    read -r name min maxcap _ <<<"$s"
    left=$((TOTAL - SUMMARY_CAP - $(elapsed)))
    if [ "$left" -lt "$min" ]; then
      not_run "$name" "${left}s left of the total cap, it needs ${min}s to start"; continue
    fi
    c=$((left < maxcap ? left : maxcap))
    case $name in
      racecheck)
        if [ -z "$SAN" ] && [ "$DRY" = 1 ]; then
          run_step racecheck "$c" "$PY" "${CASE[@]}" --only combine --json "$TMP/racecheck.json"
        elif [ -z "$SAN" ]; then
          failed racecheck "compute-sanitizer not found"
        else
          run_step racecheck "$c" "$SAN" --tool racecheck "${SAN_ARGS[@]}" "$PY" "${CASE[@]}" \
            --only combine --json "$TMP/racecheck.json" --deadline "$(deadline "$c")"
        fi ;;
      bench_plan)
        # ckpt_ext.plan on the GPU: predictions against the CUDA meter, the budgets kept, and the
        # plan beside transformers' checkpointing (the compile methods: the CPU run's)
        BP=(-m ckpt_ext.bench --section plan --device cuda --dtype bfloat16 --no-progress)
        [ "$DRY" = 1 ] && BP=(-m ckpt_ext.bench --section plan --device cpu --preset tiny
                              --no-progress)
        run_step bench_plan "$c" "$PY" "${BP[@]}" --plan-methods plan,hf-every-layer,hf-every-n \
          --out "$DEST/bench_plan" ;;
      timing)
        TM=(scripts/gpu_timing.py --json "$TMP/timing.json" --iters 10)
        [ "$DRY" = 1 ] && TM+=(--dry-run)
        run_step timing "$c" "$PY" "${TM[@]}" ;;
      bench_compile)
        BC=("${BENCH[@]}")
        [ "$DRY" = 1 ] && BC+=(--compile-backend eager)
        run_step bench_compile "$c" "$PY" "${BC[@]}" --modes "plain,$COMPILED" \
          --out "$DEST/bench_compile" ;;
    esac
    # given only what was left, and stopped by the total cap: out of time, not a failure
    if [ "${RESULT[$name]}" = timeout ] && [ "$c" -lt "$maxcap" ]; then
      RESULT[$name]=cut; NOTE[$name]="stopped at the total cap after ${c}s (out of time)"
    fi
    fold "$name" 30
  done
fi
rm -f "$DEST"/bench_*/*.md  # the tables are in the log
MAX_FILES=8  # what comes back from the GPU machine
if [ "$(find "$DEST" -type f | wc -l)" -gt $((MAX_FILES - 1)) ]; then  # + gpu_check.json to come
  say "more than $MAX_FILES files in $DEST: the plots go"; rm -f "$DEST"/bench_*/*.png
fi

# ---- summary ------------------------------------------------------------------------------------
steps=""
for k in "${ORDER[@]}"; do
  steps+="$k=${RESULT[$k]// /_}:${SECS[$k]}:${CAPS[$k]:-0}:${NOTE[$k]:-}"$'\n'
done
cat >"$TMP/summary.py" <<'EOF'
"""gpu_check.json and the result table, from the steps' files (no torch import: fast)."""
import glob, json, os, sys
dest, tmp, steps, commit, total, dry, required = sys.argv[1:8]
step_starts = dict(kv.split("=") for kv in sys.argv[8].split()) if len(sys.argv) > 8 else {}
res = {"commit": commit, "dry_run": dry == "1", "total_cap_s": int(total), "steps": {}}
for line in steps.splitlines():
    k, v = line.split("=", 1)
    result, secs, cap, note = v.split(":", 3)
    res["steps"][k] = {"result": result.replace("_", " "), "seconds": int(secs),
                       "cap_s": int(cap) or None, "note": note}
def load(name):
    try:
        return json.load(open(os.path.join(tmp, name)))
    except Exception:  # noqa: BLE001 - a step that wrote nothing
        return None
res["machine"] = load("probe.json")
notes = {}
def cut(name, why):
    """A step stopped by its cap with nothing failed: out of time, not a failure."""
    s = res["steps"].get(name)
    if s and s["result"] == "timeout":
        s["result"], s["note"] = "cut", why
# tests: the last phase report per test decides it; a test started and never reported was running
# when the step hit its cap. Selected minus finished = not run.
path = os.path.join(tmp, "tests.jsonl")
if os.path.exists(path):
    started, final, selected, cover = [], {}, None, None
    for line in open(path):
        try:
            e = json.loads(line)
        except ValueError:
            continue  # a line cut by the kill
        if "selected" in e:
            selected, cover = e["selected"], e["cover"]
        elif "start" in e:
            started.append(e["start"])
        elif final.get(e["id"], {}).get("outcome") != "failed":  # a failed phase decides
            final[e["id"]] = e
    by_file = {}
    for tid, e in final.items():
        f = by_file.setdefault(tid.split("::")[0], {"passed": 0, "failed": 0, "skipped": 0, "s": 0})
        f[e["outcome"]] += 1
        f["s"] = round(f["s"] + e["s"], 3)  # the seconds of each file: the tests cap's figures
    unfinished = [t for t in started if t not in final]
    t = {k: sum(f[k] for f in by_file.values()) for k in ("passed", "failed", "skipped")}
    order = [l.strip() for l in open(os.path.join(tmp, "tests_order.txt"))] \
        if os.path.exists(os.path.join(tmp, "tests_order.txt")) else []
    not_run = {}  # test function -> its cases not run
    for tid in order:
        if tid not in final:
            not_run[tid.split("[")[0]] = not_run.get(tid.split("[")[0], 0) + 1
    t.update(selected=selected, cover=cover,
             not_run=selected - len(final) if selected is not None else None,
             cover_done=sum(tid in final for tid in order[:cover or 0]),
             not_run_by_function=not_run, by_file=by_file, unfinished=unfinished,
             failed_ids=[f"{k}: {e['msg']}" for k, e in final.items()
                         if e["outcome"] == "failed"][:40],
             skip_reasons=sorted({e["msg"] for e in final.values()
                                  if e["outcome"] == "skipped"})[:10],
             slowest=sorted(([e["s"], k] for k, e in final.items()), reverse=True)[:10])
    res["tests"] = t
    counts = (f"{t['passed']} passed, {t['failed']} failed, {t['skipped']} skipped, "
              f"{t['not_run'] if t['not_run'] is not None else '?'} not run of "
              f"{selected if selected is not None else '?'}")
    notes["tests"] = counts + (f"; cover {t['cover_done']}/{cover}" if cover else "") \
        + (f"; running at the cap: {unfinished[0]}" if unfinished else "")
    if t["failed"] == 0 and selected is not None:  # collected, and nothing failed
        cut("tests", "cut at its cap: " + notes["tests"])
# memcheck, racecheck: each case's seconds (gpu_sanitize_case.py --json); the sanitizer's start-up
# is the time from the step's start to the case script's first line
for name in ("memcheck", "racecheck"):
    rec = load(f"{name}.json")
    if rec is None:
        continue
    step_start = int(step_starts.get(name, 0))
    rec["startup_s"] = round(rec["started_epoch"] - step_start, 1) if step_start else None
    rec["import_s"] = (round(rec["first_case_epoch"] - rec["started_epoch"], 1)
                       if "first_case_epoch" in rec else None)
    res[name] = rec
    done = len(rec["seconds"])
    finding = False
    try:
        finding = any(l.startswith("========= ") and "COMPUTE-SANITIZER" not in l
                      and "ERROR SUMMARY: 0 errors" not in l and l.strip() != "========="
                      for l in open(os.path.join(tmp, f"{name}.log"), errors="replace"))
    except OSError:
        pass
    res[name]["sanitizer_finding"] = finding
    if not rec.get("listed"):
        notes[name] = (f"{done} of {rec['cases']} cases in {sum(rec['seconds'].values()):.0f} s; "
                       f"start-up {rec['startup_s']} s (sanitizer, python), torch+ckpt_ext "
                       f"import {rec['import_s']} s")
        stopped = rec["not_run"] or done < rec["cases"]
        s = res["steps"].get(name)
        if s and stopped and not finding and s["result"] in ("pass", "timeout"):
            s["result"], s["note"] = "cut", "cut at its cap: " + notes[name]
for name in ("kernel_bench", "timing"):
    if load(f"{name}.json") is not None:
        res[name] = load(f"{name}.json")
kb = res.get("kernel_bench") or {}
if kb.get("targets"):
    tg = kb["targets"]
    missed = "".join(f"; {k} {100 * v['worst_frac']:.0f}%" for k, v in tg.items() if not v["met"])
    met = sum(v["met"] for v in tg.values())
    notes["kernel_bench"] = f"80% targets met {met}/{len(tg)}" + missed[:160]
if kb.get("not_measured"):  # it starts no shape after its --max-seconds: out of time
    s = res["steps"].get("kernel_bench")
    if s and s["result"] in ("pass", "timeout"):
        s["result"], s["note"] = "cut", (f"cut at its time limit: {len(kb['not_measured'])} "
                                         f"shapes not measured; " + notes.get("kernel_bench", ""))
for path in sorted(glob.glob(os.path.join(dest, "bench_*", "*.json"))):
    run = os.path.basename(os.path.dirname(path))
    try:
        b = json.load(open(path))
    except Exception as e:  # noqa: BLE001
        res.setdefault("bench", {})[run] = {"error": repr(e)}
        continue
    if "targets" in b:  # the plan section: its targets and the plan's predictions
        res.setdefault("bench", {})[run] = {"file": os.path.relpath(path, dest),
                                            "conditions": b.get("conditions"),
                                            "targets": b["targets"], "rows": b.get("rows")}
        met = [k for k, t in b["targets"].items() if t.get("met")]
        notes[run] = f"plan targets met {len(met)}/{len(b['targets'])}"
        continue
    chain = b.get("networks", {}).get("chain", {})
    res.setdefault("bench", {})[run] = {
        "file": os.path.relpath(path, dest), "conditions": b.get("conditions"),
        "chain": {m: {k: r.get(k) for k in ("step_ms", "time_vs_plain", "kept_for_backward",
                                            "peak_above_before_forward", "grad_rel_err", "error")
                      if k in r} for m, r in chain.items()}}
    f, c = chain.get("fused", {}).get("step_ms"), chain.get("checkpoint", {}).get("step_ms")
    if run == "bench_eager" and f and c:
        res["fused_vs_checkpoint_chain"] = round(f / c, 3)
        notes["bench_eager"] = f"chain: fused step / checkpoint step = {f / c:.2f} (target <= 1)"
ran = [s for s in res["steps"].values() if s["result"] != "not run"]
res["ok"] = all(s["result"] in ("pass", "cut") for s in ran)
# the verdict: FAIL when a step failed; CUT when nothing failed but a required step was cut (tests
# or cases not run: read its note); PASS otherwise (an optional step cut at the total cap included)
cut_required = [k for k, s in res["steps"].items() if s["result"] == "cut" and k in required.split()]
res["verdict"] = "FAIL" if not res["ok"] else "CUT" if cut_required else "PASS"
json.dump(res, open(os.path.join(dest, "gpu_check.json"), "w"), indent=1)
print(f"\n{'step':<14} {'result':<9} {'s':>4} {'cap':>4}  note")
for k, s in res["steps"].items():
    word = s["result"] if s["result"] in ("pass", "not run", "cut") else s["result"].upper()
    note = s["note"] if s["result"] == "cut" else notes.get(k, s["note"])
    print(f"{k:<14} {word:<9} {s['seconds']:>4} {s['cap_s'] or '':>4}  {note}")
n_run, n_not = len(ran), len(res["steps"]) - len(ran)
n_pass, n_cut = (sum(s["result"] == r for s in ran) for r in ("pass", "cut"))
print(f"overall: {res['verdict']} ({n_pass} of {n_run} steps that ran passed"
      + (f", {n_cut} cut ({', '.join(k for k, s in res['steps'].items() if s['result'] == 'cut')})"
         if n_cut else "") + (", nothing failed" if res["ok"] else "") + f"; {n_not} not run)"
      + ("  [dry run]" if dry == "1" else ""))
sys.exit(0 if res["ok"] else 1)
EOF
COMMIT=${GPU_CHECK_COMMIT:-$(git rev-parse --short HEAD 2>/dev/null || echo unknown)}
# the summary ends by the total cap (it absorbs the seconds spent between steps)
t=$((TOTAL - $(elapsed) - 2)); [ "$t" -lt 5 ] && t=5
required=""; for s in "${REQUIRED[@]}"; do read -r n _ <<<"$s"; required+="$n "; done
starts=""; for k in "${!STARTS[@]}"; do starts+="$k=${STARTS[$k]} "; done
timeout --kill-after=2 "$t" "$PY" "$TMP/summary.py" "$DEST" "$TMP" "$steps" \
  "$COMMIT" "$TOTAL" "$DRY" "$required" "$starts" 2>&1 | tee -a "$LOG"
rc=${PIPESTATUS[0]}
files=$(cd "$DEST" && find . -type f | sort)
say "done in $(elapsed)s of ${TOTAL}s; $(echo "$files" | grep -c .) files in $DEST: $(echo $files)"
# the summary's verdict (0: PASS or CUT, 1: FAIL); where it did not end, the steps' own results
# (a step stopped at its cap then counts as failed)
if [ "$rc" != 0 ] && [ "$rc" != 1 ]; then
  say "the summary did not end (exit $rc): the verdict from the steps' exit statuses alone"
  rc=0
  for k in "${ORDER[@]}"; do
    case ${RESULT[$k]} in pass|"not run"|cut) ;; *) rc=1 ;; esac
  done
fi
exit $rc

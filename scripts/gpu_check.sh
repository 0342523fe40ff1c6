#!/usr/bin/env bash
# One command for a GPU machine that has torch and nvcc but no internet:
#   1. builds ckpt_ext in place with the CUDA kernels (CKPT_EXT_CUDA=1: no silent CPU fallback);
#   2. runs the CUDA tests: tests/test_ops_cuda.py and every CUDA case of the other test files
#      (pytest -k cuda; the CPU suite is CI's job; GPU_CHECK_TESTS="..." passes other pytest args);
#   3. runs compute-sanitizer --tool memcheck on a small case (scripts/gpu_sanitize_case.py),
#      where the tool exists;
#   4. times forward+backward against nn.Sequential(Linear, Tanh) and stock checkpoint
#      (scripts/gpu_timing.py), and runs `python -m ckpt_ext.bench` too when that module exists;
#   5. writes gpu_check.json (device, versions, each step's status and seconds, test counts, the
#      timings) and one log per step into $OUT when set, else bench_out/gpu_check/.
# Every step runs under a timeout drawn from one budget (GPU_CHECK_BUDGET_S, default 540 s), so the
# whole script ends inside 10 minutes. Exit status: 0 when a GPU was visible and build, tests and
# sanitizer (where present) all passed.
#
#   bash scripts/gpu_check.sh            # PYTHON=... to choose the interpreter
set -uo pipefail
cd "$(dirname "$0")/.."
START=$(date +%s)
BUDGET=${GPU_CHECK_BUDGET_S:-540}
DEST=${OUT:-bench_out/gpu_check}
mkdir -p "$DEST"
if [ -n "${PYTHON:-}" ]; then PY=$PYTHON
elif [ -x .venv/bin/python ]; then PY=.venv/bin/python
else PY=python3
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
LOG="$DEST/gpu_check.log"
: >"$LOG"
say() { echo "[gpu_check $(($(date +%s) - START))s] $*" | tee -a "$LOG"; }
left() { echo $((BUDGET - ($(date +%s) - START))); }
# step NAME CAP_S LOGFILE CMD...: runs CMD under min(CAP_S, budget left), records rc and seconds.
declare -A RC SECS
step() {
  local name=$1 cap=$2 log=$3; shift 3
  local t=$(left); [ "$t" -gt "$cap" ] && t=$cap
  if [ "$t" -lt 10 ]; then say "$name: skipped, budget spent"; RC[$name]=skipped; SECS[$name]=0; return; fi
  say "$name: start (timeout ${t}s, log $(basename "$log"))"
  local s=$(date +%s)
  timeout --kill-after=10 "$t" "$@" >"$log" 2>&1
  local rc=$?
  RC[$name]=$rc; SECS[$name]=$(($(date +%s) - s))
  say "$name: rc=$rc in ${SECS[$name]}s"; tail -n 5 "$log" | sed 's/^/    /' | tee -a "$LOG"
}

say "python: $PY"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | tee -a "$LOG"
nvcc --version 2>&1 | grep release | tee -a "$LOG"
# Without a visible GPU every CUDA test would skip and the run would prove nothing: count it failed.
if "$PY" -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)" >>"$LOG" 2>&1; then
  RC[gpu]=0
else
  RC[gpu]=1; say "no GPU visible to torch: the CUDA tests will skip; this run counts as failed"
fi
SECS[gpu]=0

# 1. build (the visible GPU's arch unless TORCH_CUDA_ARCH_LIST says otherwise)
rm -f ckpt_ext/_C*.so
step build 300 "$DEST/build.log" env CKPT_EXT_CUDA=1 MAX_JOBS="${MAX_JOBS:-$(nproc)}" \
  "$PY" setup.py build_ext --inplace
grep '^ckpt_ext setup:' "$DEST/build.log" | tee -a "$LOG"

# 2. tests: the CUDA ones (test_ops_cuda.py is selected whole by -k cuda, through its name)
JUNIT=$(mktemp --suffix=.xml)
step tests 240 "$DEST/tests.log" env CKPT_EXT_EXPECT_CUDA=1 "$PY" -m pytest -q -rs \
  ${GPU_CHECK_TESTS:--k cuda tests} --junitxml="$JUNIT"

# 3. memcheck on a small case
SAN=$(command -v compute-sanitizer || true)
if [ -z "$SAN" ]; then
  TOP=$(nvcc --dryrun -c -x cu /dev/null -o /dev/null 2>&1 | sed -n 's/^#\$ TOP=//p' | head -n 1)
  for c in "${CUDA_HOME:-}" "$TOP" /usr/local/cuda; do
    [ -n "$c" ] && [ -x "$c/bin/compute-sanitizer" ] && { SAN="$c/bin/compute-sanitizer"; break; }
  done
fi
if [ -n "$SAN" ]; then
  step memcheck 180 "$DEST/sanitizer.log" env PYTORCH_NO_CUDA_MEMORY_CACHING=1 \
    "$SAN" --tool memcheck --error-exitcode 3 --print-limit 20 "$PY" scripts/gpu_sanitize_case.py
else
  say "memcheck: compute-sanitizer not found; skipped"; RC[memcheck]=absent; SECS[memcheck]=0
fi

# 4. timings
TIMING="$DEST/timing.json.tmp"
step timing 150 "$DEST/timing.log" "$PY" scripts/gpu_timing.py --json "$TIMING"
# The benchmark at the write-up's sizes (its CUDA default). torch.compile is left out by default:
# compiling three networks could eat the step's whole cap; CKPT_EXT_BENCH_ARGS overrides.
if [ -f ckpt_ext/bench.py ] || [ -d ckpt_ext/bench ]; then
  step bench 200 "$DEST/bench.log" "$PY" -m ckpt_ext.bench --out "$DEST/bench" \
    ${CKPT_EXT_BENCH_ARGS:---modes plain,checkpoint,checkpoint-reentrant,fused}
  rm -f "$DEST"/bench/*.md  # the same table is in bench.log
fi

# 5. summary
keys=""; for k in "${!RC[@]}"; do keys+="$k=${RC[$k]}:${SECS[$k]} "; done
"$PY" - "$DEST/gpu_check.json" "$JUNIT" "$TIMING" "$keys" <<'EOF' 2>&1 | tee -a "$LOG"
import json, os, subprocess, sys, xml.etree.ElementTree as ET
out, junit, timing, keys = sys.argv[1:5]
res = {"steps": {}}
for kv in keys.split():
    k, v = kv.split("=", 1)
    rc, secs = v.split(":")
    res["steps"][k] = {"rc": int(rc) if rc.lstrip("-").isdigit() else rc, "seconds": int(secs)}
try:
    import torch
    res["torch"], res["cuda"] = torch.__version__, torch.version.cuda
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        res["device"], res["capability"] = torch.cuda.get_device_name(0), f"{p.major}.{p.minor}"
except Exception as e:  # the summary must still be written
    res["torch_error"] = repr(e)
try:
    res["nvcc"] = [l for l in subprocess.run(["nvcc", "--version"], capture_output=True,
                                             text=True).stdout.splitlines() if "release" in l][0]
    res["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                   capture_output=True, text=True).stdout.strip()
except Exception as e:
    res["tool_error"] = repr(e)
if os.path.exists(junit) and os.path.getsize(junit):
    suites = ET.parse(junit).getroot()
    s = suites if suites.tag == "testsuite" else suites.find("testsuite")
    res["tests"] = {k: int(s.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    res["tests"]["failed_ids"] = [f"{c.get('classname')}::{c.get('name')}" for c in s.iter("testcase")
                                  if c.find("failure") is not None or c.find("error") is not None][:50]
    res["tests"]["skip_reasons"] = sorted({(c.find("skipped").get("message") or "")[:120]
                                           for c in s.iter("testcase") if c.find("skipped") is not None})
if os.path.exists(timing):
    res["timing"] = json.load(open(timing))
    os.remove(timing)
json.dump(res, open(out, "w"), indent=1)
print("summary:", json.dumps({k: res.get(k) for k in ("device", "torch", "cuda", "steps", "tests")}))
EOF
rm -f "$JUNIT"
# The device tool brings back at most 8 files: fold the short step logs into gpu_check.log.
for f in build sanitizer timing; do
  [ -f "$DEST/$f.log" ] && { echo "===== $f.log" >>"$LOG"; cat "$DEST/$f.log" >>"$LOG"; rm -f "$DEST/$f.log"; }
done
say "done; results in $DEST: $(cd "$DEST" && find . -type f | sort | tr '\n' ' ')"
ok=0
for k in gpu build tests memcheck; do
  case "${RC[$k]:-missing}" in 0|absent) ;; *) ok=1 ;; esac
done
exit $ok

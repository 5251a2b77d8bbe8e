#!/usr/bin/env bash
# The first-GPU check: on one GPU, in at most 8 minutes, the steps a GPU run depends on, and a JSON summary.
#
#   scripts/gpu_check.sh [--dry-run] [--out PATH] [-- <more pipeline overrides>]
#
# Steps (each with its own time limit; a failed step is recorded and the next runs):
#   env       torch, CUDA, the device's name, bf16 support
#   decoder   the decoder's exactness tests (tests/test_decoder.py, tests/test_batch.py: greedy output identical to
#             the target's, every row of a batch equal to the prompt decoded alone) with the tiny models on CUDA in
#             bfloat16 (pytest --device cuda --dtype bfloat16: tests/conftest.py)
#   pipeline  scripts/train.py, the smoke experiment's sizes on the embedded SmolLM2-135M on CUDA in bfloat16,
#             Lightning on the GPU (trainer=gpu, bf16-mixed): distill, head, collect, fit, evaluate, export
#   vllm      one vLLM engine on the GPU (bfloat16, CUDA graphs) serving that run's export (the learned rule as
#             vLLM's custom proposer: scripts/gpu_check.py vllm)
# Summary: $OUT/gpu_check.json when the device tool's $OUT is set, else ./gpu_check.json (--out PATH: there);
# "ok" is true when every step passed. Work files (logs, the run directory) stay in $GPU_CHECK_WORK or a temp dir.
#
# --dry-run: the same steps on CPU (the tiny models in float32, the tiny target in the pipeline, vLLM's CPU engine),
# what CI runs (tests/test_gpu_check.py) while no GPU is lent. GPU_CHECK_DECODER_K narrows the decoder tests (-k).
# Needs the project's environment with CUDA torch and vLLM (scripts/install.sh --vllm); PYTHON picks the interpreter.
set -u -o pipefail

DRY=0
SUMMARY=""
EXTRA=()
while [ $# -gt 0 ]; do
  case "$1" in
    --dry-run) DRY=1 ;;
    --out) SUMMARY="$2"; shift ;;
    --) shift; EXTRA=("$@"); break ;;
    *) echo "gpu_check.sh: unknown argument $1 (use --dry-run, --out PATH, -- overrides)" >&2; exit 2 ;;
  esac
  shift
done

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
cd "$ROOT"
PY="${PYTHON:-python}"
export PYTHONPATH="$ROOT${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
SUMMARY="${SUMMARY:-${OUT:+$OUT/gpu_check.json}}"
SUMMARY="${SUMMARY:-gpu_check.json}"
WORK="${GPU_CHECK_WORK:-$(mktemp -d -t gpu-check-XXXXXX)}"
mkdir -p "$WORK"
: > "$WORK/steps.tsv"

if [ "$DRY" = 1 ]; then
  DEVICE=cpu DTYPE=float32
  PIPELINE=(experiment=smoke)
  LIMITS=(60 240 300 300)
else
  DEVICE=cuda DTYPE=bfloat16
  PIPELINE=(experiment=smoke target=embedded target.device=cuda target.dtype=bfloat16 trainer=gpu)
  LIMITS=(60 110 200 150)   # 520 s of limits; a green run takes far less
fi
printf '{"mode": "%s", "device": "%s", "dtype": "%s", "commit": "%s", "started": "%s"}\n' \
  "$([ "$DRY" = 1 ] && echo dry-run || echo gpu)" "$DEVICE" "$DTYPE" \
  "$(git rev-parse --short HEAD 2>/dev/null || echo unknown)" "$(date -u +%Y-%m-%dT%H:%M:%SZ)" > "$WORK/meta.json"

step() {  # step <name> <limit s> <command...>: run it, log it, record exit code and seconds
  local name="$1" limit="$2" t0 rc
  shift 2
  t0=$(date +%s.%N)
  echo "gpu_check: $name (limit ${limit}s)" >&2
  timeout --kill-after=10 "$limit" "$@" > "$WORK/$name.log" 2>&1
  rc=$?
  printf '%s\t%s\t%s\n' "$name" "$rc" "$(awk "BEGIN {print $(date +%s.%N) - $t0}")" >> "$WORK/steps.tsv"
  echo "gpu_check: $name exit $rc" >&2
}

step env "${LIMITS[0]}" "$PY" scripts/gpu_check.py env "$WORK/env.json"
step decoder "${LIMITS[1]}" "$PY" -m pytest -q -p no:cacheprovider tests/test_decoder.py tests/test_batch.py \
  -m "not slow" -k "${GPU_CHECK_DECODER_K:-equal or exact or identical}" --device "$DEVICE" --dtype "$DTYPE"
step pipeline "${LIMITS[2]}" "$PY" scripts/train.py "${PIPELINE[@]}" "hydra.run.dir=$WORK/run" "${EXTRA[@]}"
step vllm "${LIMITS[3]}" "$PY" scripts/gpu_check.py vllm "$WORK/run" "$WORK/vllm.json"

"$PY" scripts/gpu_check.py summary "$WORK" "$SUMMARY"
echo "gpu_check: summary in $SUMMARY (work files in $WORK)" >&2
"$PY" -c "import json, sys; sys.exit(0 if json.load(open(sys.argv[1]))['ok'] else 1)" "$SUMMARY"

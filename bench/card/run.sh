#!/usr/bin/env bash
# The card's proof in one run, on a lent GPU host (PyTorch, torchvision and TensorBoard there; no
# Docker, no network): the GPU tests; `python -m bench cuda` (fp32 and bf16 + channels_last, 1 and
# 2 workers, async, --overlap, sync, allreduce, CUDA graphs on and off, the GPU idle column);
# `python -m bench constants` (the PS's AdamW step on the host's cores, the transport's round
# trips); and async against diloco on configs/cpu-lm.yaml (`orchestrator local`, on the host's
# CPU cores). Every part is time-boxed, so a slow one leaves the others their time, and writes
# into OUT (the device tool's $OUT, else card-out/). The wheels the host lacks come from
# .cache/card-wheels/ (bench/card/wheels.sh; carry it).
#
#   DEVICE=cpu bench/card/run.sh     # the same run, small, on a CPU: try it before the card
#   PARTS="gpu-tests cuda" ...        # some parts only (default: every one)
#
# At most 560 s in all (the device tool's command limit is 600 s).
set -u
cd "$(dirname "$0")/../.."
OUT=${OUT:-card-out}
DEVICE=${DEVICE:-cuda}
PY=${PY:-python3}
SITE=.cache/card-site
mkdir -p "$OUT"
started=$(date +%s)

PARTS=${PARTS:-gpu-tests cuda constants lm-async lm-diloco}
part() {  # part NAME SECONDS COMMAND...: its output in OUT/NAME.log, its last lines and exit here
    local name=$1 limit=$2 begun
    shift 2
    case " $PARTS " in *" $name "*) ;; *) return 0 ;; esac
    begun=$(date +%s)
    echo "== $name (at most ${limit} s): $*"
    timeout -k 10 "$limit" "$@" > "$OUT/$name.log" 2>&1
    echo "== $name: exit $? after $(($(date +%s) - begun)) s (run: $(($(date +%s) - started)) s)"
    tail -n "${TAIL:-25}" "$OUT/$name.log"
}

"$PY" -m pip install -q --no-index --find-links .cache/card-wheels --target "$SITE" \
    pyzmq pyyaml pydantic docker safetensors shtab pytest pytest-timeout > "$OUT/wheels.log" 2>&1 \
    || { echo "wheels not installed (bench/card/wheels.sh, then carry .cache/card-wheels):"; tail -5 "$OUT/wheels.log"; }
export PYTHONPATH="$PWD:$PWD/$SITE${PYTHONPATH:+:$PYTHONPATH}"
"$PY" - <<'PYTHON' | tee "$OUT/device.txt"
import os, platform, torch
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no CUDA GPU"
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, {gpu}, {os.cpu_count()} cores, Python {platform.python_version()}")
PYTHON
nvidia-smi > "$OUT/nvidia-smi.txt" 2>&1 || true

# The GPU tests, and the CPU ones beside them but the one that trains on digits, whose file ships
# inside scikit-learn (too large to carry for every Python a host may have) where it is missing.
deselect=()
"$PY" -c 'import sklearn' 2> /dev/null \
    || deselect=(--deselect tests/app/worker/test_graphed.py::test_a_cpu_cluster_with_cuda_graphs_learns_digits_eagerly)
part gpu-tests 90 "$PY" -m pytest -q -p no:cacheprovider -rs "${deselect[@]}" \
    tests/app/worker/test_gpu_step.py tests/app/worker/test_graphed.py
if [ "$DEVICE" = cuda ]; then
    part cuda 300 "$PY" -m bench cuda --budget 240 --out "$OUT/cuda"
else
    part cuda 240 "$PY" -m bench cuda --device cpu --batch 4 --image-size 32 --classes 2 --per-class 12 \
        --warmup 2 --steps 4 --profile-steps 2 --only fp32-async-1-auto fp32-overlap-1-auto --out "$OUT/cuda"
fi
part constants 80 "$PY" -m bench constants --json "$OUT/constants.json"
for strategy in async diloco; do
    part "lm-$strategy" 45 "$PY" -m orchestrator local -c configs/cpu-lm.yaml --name "card-lm-$strategy" \
        "train.strategy=$strategy" train.eval_every=1000
done
echo "== done in $(($(date +%s) - started)) s; everything is in $OUT/"

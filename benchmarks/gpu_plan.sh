#!/usr/bin/env bash
# The GPU figures, as steps small enough for one call of a lent GPU machine (10 minutes a command, 15 minutes
# of device time a task, its start included): `bash benchmarks/gpu_plan.sh essentials` runs the most telling
# steps in order, each capped by `timeout` at its LIMIT, within 9 minutes on an H100; a step that fails or is
# cut off does not stop the next.  `list` names every step; the others run by name, most telling first, e.g.
# `bash benchmarks/gpu_plan.sh fedldf models`.  Each step writes its JSON (and PNG) into $OUT when set
# (the device tool's folder that comes back), else into benchmarks/results, named with "gpu" and the step;
# `fedpartial bench` rewrites its JSON after each cell's warm-up and timing, so a step cut off at its limit
# keeps what it measured.  Nothing is installed: the fedpartial tree is put on PYTHONPATH and the machine's
# own JAX is used.  `--within SECONDS` keeps the whole plan inside one call: each step gets at most what is left
# (less 10 s), and a step left under 20 s is not run.  `--dry-run` prints each step's limit and command instead of running it
# (tests/benchmarks/test_gpu_plan.py checks that every command is valid for the current CLI).
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DIR=${OUT:-benchmarks/results}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BENCH="$PY -m fedpartial bench --preset full --rounds 3"

# Limits: about 1.5x each step's time on the first H100 run (2026-11-27: check 5 s, cnn1000 67 s, vgg9 93 s,
# seeds 93 s, cohort10k 71 s, seeds100 99 s; probe was cut off at 150 s inside its last case).  convcnn and
# convvgg (issue 52: 4 fused cells and the plain loop each, the JSON rewritten after every cell) have not run on a
# GPU yet: their limits are guesses from cnn1000's and vgg9's times; they replace those two in the essentials.
declare -A WHAT CMD LIMIT
ESSENTIALS=(check convcnn convvgg seeds cohort10k)
STEPS=("${ESSENTIALS[@]}" vggprec cnn1000 vgg9 probe seeds100 fedldf models placement replicas lora1000 tests)
WHAT[check]="versions and devices seen by JAX (seconds)"
CMD[check]="$PY -c 'import jax, flax, optax, fedpartial; print(jax.__version__, flax.__version__, optax.__version__, fedpartial.__version__, jax.devices())'"
LIMIT[check]=30
CONV="$PY -m benchmarks.conv_lowering --no-auto --rounds 2 --local-steps 2 --batch-size 32 --strategies fused --lowerings lax,hybrid --dtypes float32,bfloat16"
WHAT[convcnn]="the convolution lowerings (lax: grouped convs; hybrid: batched GEMMs) and bfloat16, fused, on the 1,000-client CNN (28x28) against the plain loop: x loop and % of matmul (targets: 20x, the conv probe's shared-weight ceiling)"
CMD[convcnn]="$CONV --rows cnn2c1f@28x28x1:1000 --out $DIR/conv-lowering-gpu-cnn1000.json"
LIMIT[convcnn]=120
WHAT[convvgg]="the same for VGG-9 at K = 100 (32x32x3, lr 0.01; target: 30% of the matmul rate)"
CMD[convvgg]="$CONV --lr 0.01 --rows vgg9@32x32x3:100 --out $DIR/conv-lowering-gpu-vgg9.json"
LIMIT[convvgg]=140
WHAT[vggprec]="VGG-9's check against the plain loop at full float32 (convvgg runs at the GPU's default, TF32): a difference over 1e-3 that stays here is a bug, not precision"
CMD[vggprec]="$PY -m benchmarks.conv_lowering --no-auto --rounds 1 --local-steps 2 --batch-size 32 --strategies fused --lowerings lax,hybrid --dtypes float32 --lr 0.01 --matmul-precision highest --rows vgg9@32x32x3:100 --out $DIR/conv-lowering-gpu-vgg9-highest.json"
LIMIT[vggprec]=120
WHAT[cnn1000]="target: a 1,000-client CNN cohort (fused, fused:100) at least 20x the plain loop (the loop runs 100 clients and is scaled)"
CMD[cnn1000]="$BENCH --models cnn2c1f --cohorts 1000 --methods fedavg --strategies fused,fused:100 --out $DIR/throughput-gpu-cnn1000.json"
LIMIT[cnn1000]=110
WHAT[vgg9]="target: VGG-9 at K = 100 at least 30% of the measured matmul FLOP/s (lr 0.01: at 0.05 it diverges on random data, and the check against the plain loop means nothing)"
CMD[vgg9]="$BENCH --models vgg9 --cohorts 100 --methods fedavg --strategies fused --lr 0.01 --out $DIR/throughput-gpu-vgg9.json"
LIMIT[vgg9]=140
WHAT[seeds]="target: 4 seeds vmapped at least 0.8*4x faster than one after another (MLP on synthetic, CNN on digits)"
CMD[seeds]="$PY -m benchmarks.seeds --repeats 1 --out $DIR/seeds-gpu.json"
LIMIT[seeds]=140
WHAT[cohort10k]="the largest cohort: MLP at K = 10,000, whole cohort and streamed in chunks of 1,000"
CMD[cohort10k]="$BENCH --models mlp --cohorts 10000 --methods fedavg --strategies fused,stream:1000 --out $DIR/throughput-gpu-cohort10k.json"
LIMIT[cohort10k]=110
WHAT[probe]="where a cohort's conv step goes: one step of K clients plain, vmapped (grouped convs), lax.map, shared weights"
CMD[probe]="$PY -m benchmarks.conv_probe --models cnn2c1f --cohorts 100,1000 --out $DIR/conv-probe-gpu-cnn.json \
&& $PY -m benchmarks.conv_probe --models vgg9 --cohorts 100 --out $DIR/conv-probe-gpu-vgg9.json"
LIMIT[probe]=220
WHAT[seeds100]="the seeds speed-up where the cohort is larger: 4 seeds, N = 100, K = 50"
CMD[seeds100]="$PY -m benchmarks.seeds --clients 100 --cohort 50 --repeats 1 --out $DIR/seeds-gpu-k50.json"
LIMIT[seeds100]=150
WHAT[fedldf]="FedLDF's round time over FedAvg's: VGG-9 and the CNN at K = 100"
CMD[fedldf]="$BENCH --models vgg9,cnn2c1f --cohorts 100 --methods fedavg,fedldf --strategies fused --lr 0.01 --out $DIR/throughput-gpu-fedldf.json"
LIMIT[fedldf]=300
WHAT[models]="ratios to the plain loop for MLP, LeNet5, ResNet20 at K = 10 ... 1,000, FedAvg/FedLDF/FedSPU"
CMD[models]="$BENCH --models mlp,lenet5,resnet20 --cohorts 10,100,1000 --methods fedavg,fedldf,fedspu --strategies auto,fused:100 --out $DIR/throughput-gpu-models.json"
LIMIT[models]=580
WHAT[placement]="end-to-end rounds/s with data on the device vs packed on the host, per-round time split"
CMD[placement]="$PY -m benchmarks.data_placement --out $DIR/data-placement-gpu.json"
LIMIT[placement]=300
WHAT[replicas]="the --seeds memory check: FedSPU, 4 seeds, device peak against the estimate per replica axis"
CMD[replicas]="$PY -m benchmarks.replica_memory --out $DIR/replica-memory-gpu.json"
LIMIT[replicas]=300
WHAT[lora1000]="K = 1,000 LoRA clients (rank 8) over one base held once (an MLP of three 4096-unit layers, 34 MB), run: round time and device peak against XLA's buffer assignment; the stacked baseline to K = 100 (not yet run on a GPU: the limit is a guess)"
CMD[lora1000]="$PY -m benchmarks.lora_memory --cohorts 10,100,1000 --width 4096 --rank 8 --stacked-up-to 100 --run --out $DIR/lora-memory-gpu.json"
LIMIT[lora1000]=300
WHAT[tests]="the default test suite on the GPU (4 workers sharing it, no preallocation; tests needing a package the machine lacks, e.g. mlxtend, fail), log next to the JSON"
CMD[tests]="XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -n 4 -q --durations=20 2>&1 | tee $DIR/tests-gpu.log"
LIMIT[tests]=580

dry=0 within=0
while [[ ${1:-} == --* ]]; do
  case $1 in
    --dry-run) dry=1; shift ;;
    --within) within=${2:-}; shift 2 ;;
    *) echo "gpu_plan.sh: option '$1' is unknown; use --dry-run or --within SECONDS." >&2; exit 2 ;;
  esac
done
if ! [[ $within =~ ^[0-9]+$ ]]; then
  echo "gpu_plan.sh: --within takes whole seconds, not '$within'." >&2; exit 2
fi
if [[ $# -eq 0 || $1 == list ]]; then
  for s in "${STEPS[@]}"; do printf '%-10s %4ss  %s\n' "$s" "${LIMIT[$s]}" "${WHAT[$s]}"; done
  total=0; for s in "${ESSENTIALS[@]}"; do total=$(( total + LIMIT[$s] )); done
  printf '%-10s %4ss  %s\n' essentials "$total" \
    "the steps ${ESSENTIALS[*]}, in that order"
  exit 0
fi
named=()  # 'all' and 'essentials' expand where they stand, so more steps can follow them
for s in "$@"; do
  case $s in all) named+=("${STEPS[@]}") ;; essentials) named+=("${ESSENTIALS[@]}") ;; *) named+=("$s") ;; esac
done
set -- "${named[@]}"
for s in "$@"; do
  if [[ -z ${CMD[$s]+x} ]]; then
    echo "gpu_plan.sh: step '$s' is unknown; choose from: ${STEPS[*]} (or list, essentials, all)." >&2
    exit 2
  fi
done
(( dry )) || mkdir -p "$DIR"
failed=()
began=$(date +%s)
for s in "$@"; do
  if (( dry )); then
    printf '%s\t%s\t%s\n' "$s" "${LIMIT[$s]}" "${CMD[$s]}"
  else
    limit=${LIMIT[$s]}
    if (( within )); then  # the whole plan within a call's time: each step gets at most what is left
      left=$(( within - ($(date +%s) - began) - 10 ))
      (( left < limit )) && limit=$left
      if (( limit < 20 )); then echo "== $s not run: $(( left > 0 ? left : 0 )) s of --within left"; failed+=("$s"); continue; fi
    fi
    echo "== $s (at most $limit s): ${WHAT[$s]}"
    start=$(date +%s)
    status=0
    timeout --signal=TERM --kill-after=10 "$limit" bash -o pipefail -c "${CMD[$s]}" || status=$?
    (( status == 124 )) && echo "== $s was cut off at its limit of $limit s (its JSON keeps what it measured)"
    (( status != 0 )) && failed+=("$s")
    echo "== $s took $(( $(date +%s) - start )) s, exit status $status"
  fi
done
if (( ${#failed[@]} )); then
  echo "gpu_plan.sh: these steps failed or were cut off: ${failed[*]}" >&2
  exit 1
fi

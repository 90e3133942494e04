#!/usr/bin/env bash
# The GPU figures of the scale issue, as steps small enough for one call of a lent GPU machine (10 minutes a
# command, about 30 minutes a session): run `bash benchmarks/gpu_plan.sh list`, then the steps in order,
# e.g. `bash benchmarks/gpu_plan.sh check cnn1000`.  Each step writes its JSON (and PNG) into $OUT when set
# (the device tool's folder that comes back), else into benchmarks/results, named with "gpu" and the step;
# `fedpartial bench` rewrites its JSON after every cell, so a step cut off at its limit keeps what it measured.
# Nothing is installed: the fedpartial tree is put on PYTHONPATH and the machine's own JAX is used.
# `--dry-run` prints each step's command instead of running it (tests/benchmarks/test_gpu_plan.py checks
# that every command is valid for the current CLI).  The step sizes are guesses: no GPU has run them yet.
set -euo pipefail
cd "$(dirname "$0")/.."

PY=${PYTHON:-python3}
DIR=${OUT:-benchmarks/results}
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
BENCH="$PY -m fedpartial bench --preset full --rounds 3"

declare -A WHAT CMD
STEPS=(check cnn1000 vgg9 models cohort10k seeds placement replicas tests)
WHAT[check]="versions and devices seen by JAX (seconds)"
CMD[check]="$PY -c 'import jax, flax, optax, fedpartial; print(jax.__version__, flax.__version__, optax.__version__, fedpartial.__version__, jax.devices())'"
WHAT[cnn1000]="target: a 1,000-client CNN cohort at least 20x the plain loop (the loop runs 100 clients and is scaled)"
CMD[cnn1000]="$BENCH --models cnn2c1f --cohorts 1000 --methods fedavg,fedldf --strategies auto,fused:100 --out $DIR/throughput-gpu-cnn1000.json"
WHAT[vgg9]="target: VGG-9 at least 30% of the measured matmul FLOP/s; FedLDF's overhead"
CMD[vgg9]="$BENCH --models vgg9 --cohorts 10,100 --methods fedavg,fedldf --strategies auto --out $DIR/throughput-gpu-vgg9.json"
WHAT[models]="ratios to the plain loop for MLP, LeNet5, ResNet20 at K = 10 ... 1,000, FedAvg/FedLDF/FedSPU"
CMD[models]="$BENCH --models mlp,lenet5,resnet20 --cohorts 10,100,1000 --methods fedavg,fedldf,fedspu --strategies auto,fused:100 --out $DIR/throughput-gpu-models.json"
WHAT[cohort10k]="the largest cohort: MLP at K = 10,000, whole cohort and streamed in chunks of 1,000"
CMD[cohort10k]="$BENCH --models mlp --cohorts 10000 --methods fedavg,fedldf --strategies auto,stream:1000 --out $DIR/throughput-gpu-cohort10k.json"
WHAT[seeds]="the seeds speed-up: 4 seeds vmapped vs one after another (MLP on synthetic, CNN on digits)"
CMD[seeds]="$PY -m benchmarks.seeds --out $DIR/seeds-gpu.json"
WHAT[placement]="end-to-end rounds/s with data on the device vs packed on the host, per-round time split"
CMD[placement]="$PY -m benchmarks.data_placement --out $DIR/data-placement-gpu.json"
WHAT[replicas]="the --seeds memory check: FedSPU, 4 seeds, device peak against the estimate per replica axis"
CMD[replicas]="$PY -m benchmarks.replica_memory --out $DIR/replica-memory-gpu.json"
WHAT[tests]="the default test suite on the GPU (4 workers sharing it, no preallocation; tests needing a package the machine lacks, e.g. mlxtend, fail), log next to the JSON"
CMD[tests]="XLA_PYTHON_CLIENT_PREALLOCATE=false $PY -m pytest -n 4 -q --durations=20 2>&1 | tee $DIR/tests-gpu.log"

dry=0
if [[ ${1:-} == --dry-run ]]; then dry=1; shift; fi
if [[ $# -eq 0 || $1 == list ]]; then
  for s in "${STEPS[@]}"; do printf '%-10s %s\n' "$s" "${WHAT[$s]}"; done
  exit 0
fi
[[ $1 == all ]] && set -- "${STEPS[@]}"
for s in "$@"; do
  if [[ -z ${CMD[$s]+x} ]]; then
    echo "gpu_plan.sh: step '$s' is unknown; choose from: ${STEPS[*]} (or list, all)." >&2
    exit 2
  fi
done
(( dry )) || mkdir -p "$DIR"
for s in "$@"; do
  if (( dry )); then
    printf '%s\t%s\n' "$s" "${CMD[$s]}"
  else
    echo "== $s: ${WHAT[$s]}"
    start=$(date +%s)
    bash -o pipefail -c "${CMD[$s]}"
    echo "== $s took $(( $(date +%s) - start )) s"
  fi
done

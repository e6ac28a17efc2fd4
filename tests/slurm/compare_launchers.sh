#!/usr/bin/env bash
# srun vs srun + torchrun, on the local cluster: the same train.py, data, model and batch size,
# submitted with part 4's job scripts; configurations interleaved (order reversed every other
# round), ROUNDS times, medians at the end.
#
#   DDP_SLURM_TASK_PLUGIN=task/affinity tests/slurm/cluster.sh start 1   # srun binds tasks to cores
#   tests/slurm/compare_launchers.sh 5 | tee launchers.csv
#
# Configurations (one node, 2 CPUs, 2 training processes):
#   srun            job_srun_1node.sbatch as is: 2 tasks x 1 CPU, each bound to its core, 1 thread each
#   srun-nobind     the same with SLURM_CPU_BIND=none: tasks float over both cores
#   torchrun        job_torchrun_1node.sbatch as is: 1 task x 2 CPUs for torchrun and its 2 workers
#   torchrun-1cpu   the same with --cpus-per-task=1, the srun script's value: both workers share 1 core
#   torchrun-omp    seed 003's command: OMP_NUM_THREADS=cpus-per-task (2) for each of the 2 workers
set -euo pipefail
cd "$(dirname "$0")/../.."

ROUNDS="${1:-5}"
eval "$(tests/slurm/cluster.sh env)"
TRAIN_ARGS="--dataset fake --fake-size 512 --model test_resnet --batch-size 32 --workers 0 --epochs 2 --checkpoint ''"
eval "TRAIN=($TRAIN_ARGS)"
OUT="$(mktemp -d)"

# What seed 003's torchrun job does, on this cluster: OMP_NUM_THREADS = the task's CPUs, per worker.
SEED_COMMAND='OMP_NUM_THREADS=$SLURM_CPUS_PER_TASK srun --cpus-per-task=$SLURM_CPUS_PER_TASK torchrun --nnodes=1 --nproc_per_node=2 --rdzv_backend=c10d --rdzv_endpoint=127.0.0.1:$((15000 + SLURM_JOB_ID % 20000)) --rdzv_id=$SLURM_JOB_ID part4_torchrun/train.py '"$TRAIN_ARGS"

submit() {  # submit NAME SBATCH-ARGS...: prints "NAME,wall_s,samples_per_s,epoch_s,threads,load"
    local name="$1" id start state out
    shift
    start=$(date +%s.%N)
    id=$(sbatch --parsable --time=10 --output="$OUT/%j.out" --error="$OUT/%j.err" "$@")
    while state=$(scontrol show job "$id" --oneliner | grep -o 'JobState=[A-Z]*'); [[ "$state" =~ PENDING|RUNNING|COMPLETING|CONFIGURING ]]; do
        sleep 0.2
    done
    out="$OUT/$id.out"
    [[ "$state" == JobState=COMPLETED ]] || { echo "$name: job $id $state, see $OUT" >&2; return 1; }
    # epoch 2 (the first one pays for warm-up): samples/s and seconds; threads per process
    echo "$name,$(echo "$(date +%s.%N) - $start" | bc),$(grep '^epoch 2/2' "$out" | sed -E 's/.*samples\/s=([0-9.]+) epoch_s=([0-9.]+)/\1,\2/'),$(grep -o 'threads=[0-9]*' "$out" | sort -u | tr '\n' ' ' | sed 's/threads=//g; s/ $//'),$(cut -d' ' -f1 /proc/loadavg)"
}

run_config() {
    case "$1" in
        srun) submit srun part4_torchrun/job_srun_1node.sbatch "${TRAIN[@]}" ;;
        torchrun) submit torchrun part4_torchrun/job_torchrun_1node.sbatch "${TRAIN[@]}" ;;
        srun-nobind) submit srun-nobind --export=ALL,SLURM_CPU_BIND=none part4_torchrun/job_srun_1node.sbatch "${TRAIN[@]}" ;;
        torchrun-1cpu) submit torchrun-1cpu --cpus-per-task=1 part4_torchrun/job_torchrun_1node.sbatch "${TRAIN[@]}" ;;
        torchrun-omp) submit torchrun-omp --ntasks-per-node=1 --cpus-per-task=2 --wrap="$SEED_COMMAND" ;;
    esac
}

CONFIGS=(srun torchrun srun-nobind torchrun-1cpu torchrun-omp)
for ((round = 0; round <= ROUNDS; round++)); do
    if ((round == 0)); then echo "round,config,wall_s,samples_per_s,epoch_s,threads,load1"; continue; fi
    order=("${CONFIGS[@]}")
    if ((round % 2 == 0)); then order=(); for c in "${CONFIGS[@]}"; do order=("$c" "${order[@]}"); done; fi  # reversed
    for config in "${order[@]}"; do run_config "$config" | sed "s/^/$round,/"; done
done | tee "$OUT/results.csv"

python - "$OUT/results.csv" <<'EOF' >&2
import csv, statistics, sys
rows = list(csv.DictReader(open(sys.argv[1])))
print(f"{'config':15} {'median samples/s':>17} {'min-max':>15} {'median epoch_s':>15} {'median wall_s':>14}  threads")
for name in dict.fromkeys(r["config"] for r in rows):
    mine = [r for r in rows if r["config"] == name]
    rate = [float(r["samples_per_s"]) for r in mine]
    print(f"{name:15} {statistics.median(rate):17.1f} {min(rate):7.1f}-{max(rate):<7.1f} "
          f"{statistics.median(float(r['epoch_s']) for r in mine):15.2f} "
          f"{statistics.median(float(r['wall_s']) for r in mine):14.1f}  {mine[0]['threads']}")
EOF

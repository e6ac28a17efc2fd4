#!/usr/bin/env bash
# A real Slurm cluster of 1 or 2 nodes on this one machine, for trying the job scripts and
# for the tests. Needs root and Debian's packages (see .ci/run):
#   apt-get install --no-install-recommends slurmctld slurmd slurm-client munge
#
# From the repository root:
#   part4_torchrun/slurm/local/cluster.sh start 2   # idempotent; 2 nodes, restarts if it had 1
#   eval "$(part4_torchrun/slurm/local/cluster.sh env)"   # SLURM_CONF for sbatch, srun, squeue
#   sbatch --wait part4_torchrun/slurm/job_srun_2nodes.sbatch --dataset fake --epochs 1
#   part4_torchrun/slurm/local/cluster.sh status    # exit 0 when up
#   part4_torchrun/slurm/local/cluster.sh stop      # cancels its jobs, stops only its daemons
#
# Everything (config, munge key and socket, state, logs, pid files) lives in one private
# directory, DDP_SLURM_DIR (default /tmp/ddp-course-slurm). Ports: DDP_SLURM_PORT for the
# controller (default 12817: outside the job scripts' 15000-31999 and the kernel's ephemeral
# ports) and the next ones, one slurmd per node. Job ids start at DDP_SLURM_FIRST_JOB_ID
# (default 1); the job scripts derive their port from it. Nodes are named 127.0.0.1 and
# 127.0.0.2: names that resolve to this machine. DDP_SLURM_CPUS: CPUs per node (default: the
# machine's cores, at least 2); DDP_SLURM_TASK_PLUGIN=task/affinity makes srun bind tasks to cores.
set -euo pipefail

DIR="${DDP_SLURM_DIR:-/tmp/ddp-course-slurm}"
PORT="${DDP_SLURM_PORT:-12817}"
FIRST_JOB_ID="${DDP_SLURM_FIRST_JOB_ID:-1}"
TASK_PLUGIN="${DDP_SLURM_TASK_PLUGIN:-task/none}"
CORES="$(nproc)"
# CPUs per node; config_overrides lets them exceed the cores
CPUS="${DDP_SLURM_CPUS:-$((CORES > 2 ? CORES : 2))}"
HERE="$(cd "$(dirname "$0")" && pwd)"
CONF="$DIR/slurm.conf"
export SLURM_CONF="$CONF"

die() { echo "cluster.sh: $*" >&2; exit 1; }
node_name() { echo "127.0.0.$1"; }

# A daemon killed here can stay a zombie (nobody reaps it), which `kill -0` calls alive.
# Alive means: the pid file's process exists, is not a zombie, and runs the expected program.
alive() {  # alive PIDFILE PROGRAM
    local pid stat
    [[ -s "$1" ]] || return 1
    pid="$(<"$1")"
    [[ "$pid" =~ ^[0-9]+$ && -r "/proc/$pid/stat" ]] || return 1
    [[ "$(cat "/proc/$pid/comm" 2>/dev/null)" == "$2"* ]] || return 1
    stat="$(sed 's/^.*) //' "/proc/$pid/stat" 2>/dev/null | cut -d' ' -f1)"
    [[ -n "$stat" && "$stat" != Z && "$stat" != X ]]
}

daemons() {  # "PIDFILE PROGRAM" for every daemon this cluster started (pid files are ours alone)
    local pidfile
    echo "$DIR/munge/munged.pid munged"
    echo "$DIR/slurmctld.pid slurmctld"
    for pidfile in "$DIR"/slurmd.*.pid; do [[ -e "$pidfile" ]] && echo "$pidfile slurmd"; done
    return 0
}

all_alive() {  # the cluster of $DIR/nodes nodes is complete
    local pidfile program n
    [[ -s "$DIR/nodes" ]] || return 1
    for ((n = 1; n <= $(<"$DIR/nodes"); n++)); do
        alive "$DIR/slurmd.$(node_name "$n").pid" slurmd || return 1
    done
    while read -r pidfile program; do alive "$pidfile" "$program" || return 1; done < <(daemons)
}

wait_for() {  # wait_for SECONDS DESCRIPTION COMMAND...
    local seconds="$1" what="$2" i
    shift 2
    for ((i = 0; i < seconds * 10; i++)); do "$@" && return 0; sleep 0.1; done
    die "timed out after ${seconds} s waiting for $what (logs: $DIR/log, $DIR/munge/munged.log)"
}

nodes_in() {  # nodes_in REGEX: every node's state matches
    local states
    states="$(sinfo -h -N -o '%t' 2>/dev/null)" || return 1
    [[ -n "$states" && -z "$(grep -Ev "^($1)\$" <<<"$states")" ]]
}

no_jobs() { [[ -z "$(squeue -h -o %i 2>/dev/null)" ]]; }

config() {  # config NODES: the slurm.conf for NODES nodes, on stdout
    local n
    sed -e "s|@DIR@|$DIR|g" -e "s|@CTLD_PORT@|$PORT|g" -e "s|@TASK_PLUGIN@|$TASK_PLUGIN|g" \
        -e "s|@FIRST_JOB_ID@|$FIRST_JOB_ID|g" \
        -e "s|@HOST@|$(hostname -s)|g" "$HERE/slurm.conf.in"
    for ((n = 1; n <= $1; n++)); do
        echo "NodeName=$(node_name "$n") Port=$((PORT + n)) CPUs=$CPUS State=UNKNOWN"
    done
    echo "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP"
}

start_munge() {
    # munged refuses keys that others could read and sockets they could replace: its own directory.
    # Others may reach the socket, not list or read the directory.
    install -d -o munge -g munge -m 0711 "$DIR/munge"
    if [[ ! -s "$DIR/munge/munge.key" ]]; then
        runuser -u munge -- mungekey --create --keyfile="$DIR/munge/munge.key"
    fi
    runuser -u munge -- munged --socket="$DIR/munge/munge.socket" \
        --key-file="$DIR/munge/munge.key" --pid-file="$DIR/munge/munged.pid" \
        --log-file="$DIR/munge/munged.log" --seed-file="$DIR/munge/munged.seed"
    wait_for 10 munged alive "$DIR/munge/munged.pid" munged
}

start() {  # start NODES
    local nodes="$1" n
    [[ "$nodes" == 1 || "$nodes" == 2 ]] || die "usage: $0 start 1|2"
    [[ "$(id -u)" == 0 ]] || die "needs root (slurmd runs jobs as their users)"
    for program in slurmctld slurmd munged sinfo; do
        command -v "$program" >/dev/null || die "$program not found:" \
            "apt-get install --no-install-recommends slurmctld slurmd slurm-client munge"
    done
    # Up with the very same configuration (nodes, CPUs, plugins, ports), nodes answering: keep
    # it, and the jobs it may be running.
    if all_alive && [[ "$(config "$nodes")" == "$(cat "$CONF")" ]] \
        && nodes_in "idle|alloc|mix|comp"; then
        echo "cluster.sh: already up with $nodes node(s); export SLURM_CONF=$CONF"
        return 0
    fi
    stop quiet
    mkdir -p "$DIR/state" "$DIR/log" "$DIR/spool"
    config "$nodes" >"$CONF"
    echo "$nodes" >"$DIR/nodes"
    start_munge
    slurmctld -c -f "$CONF"  # -c: a fresh start, no jobs or node states from an earlier run
    wait_for 15 slurmctld alive "$DIR/slurmctld.pid" slurmctld
    for ((n = 1; n <= nodes; n++)); do
        mkdir -p "$DIR/spool/$(node_name "$n")"
        slurmd -f "$CONF" -N "$(node_name "$n")"
    done
    wait_for 30 "idle nodes" nodes_in idle
    echo "cluster.sh: up with $nodes node(s) ($CPUS CPUs each, $TASK_PLUGIN);" \
        "export SLURM_CONF=$CONF"
}

stop() {
    local pidfile program i
    [[ -d "$DIR" ]] || return 0
    if alive "$DIR/slurmctld.pid" slurmctld && alive "$DIR/munge/munged.pid" munged; then
        # Our private cluster: every job in it is ours.
        scancel --user="$(id -un)" 2>/dev/null || true
        for ((i = 0; i < 100; i++)); do no_jobs && break; sleep 0.1; done
    fi
    # slurmd first (they tell slurmctld goodbye), munged last (everybody authenticates with it).
    while read -r pidfile program; do
        if alive "$pidfile" "$program"; then kill -TERM "$(<"$pidfile")"; fi
    done < <(daemons | tac)
    while read -r pidfile program; do
        for ((i = 0; i < 100; i++)); do alive "$pidfile" "$program" || break; sleep 0.1; done
        if alive "$pidfile" "$program"; then kill -KILL "$(<"$pidfile")"; fi
        rm -f "$pidfile"
    done < <(daemons | tac)
    rm -f "$DIR/nodes"
    [[ "${1:-}" == quiet ]] || echo "cluster.sh: stopped"
}

status() {
    if all_alive; then
        echo "cluster.sh: up with $(<"$DIR/nodes") node(s); SLURM_CONF=$CONF"
        sinfo -N -o '%N %t %c' || true
        return 0
    fi
    echo "cluster.sh: not running"
    return 1
}

case "${1:-}" in
    start) start "${2:-1}" ;;
    stop) stop ;;
    status) status ;;
    env) echo "export SLURM_CONF=$CONF" ;;
    *) die "usage: $0 start 1|2 | stop | status | env" ;;
esac

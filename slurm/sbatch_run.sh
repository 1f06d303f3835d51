#!/usr/bin/env bash
# Multi-node training under Slurm: one `torchrun` per node, c10d rendezvous at the head node.
#
#   sbatch slurm/sbatch_run.sh [hydra overrides ...]
#   sbatch --nodes=4 --gpus-per-node=8 --cpus-per-task=48 slurm/sbatch_run.sh \
#       trainer_config.snapshot_path=s3://bucket/gpt_snapshot.pt
#
# Options given to sbatch override the #SBATCH defaults below. No GPU is requested here: Slurm
# rejects a GPU request on nodes that have none, so ask for GPUs when you submit
# (`--gpus-per-node=8`, or `export SBATCH_GPUS_PER_NODE=8`).
#
# sbatch passes the submitting environment to the job, so submit from the environment that trains
# (an activated venv puts its `torchrun` on PATH). These variables tune the run:
#   NPROC_PER_NODE  training processes per node (default: the GPUs Slurm gave each node, else 1)
#   MAX_RESTARTS    times torchrun restarts every node's workers after a failure (default 3)
#   RDZV_PORT       rendezvous port on the head node (default 29500 + job id % 1000, so that jobs
#                   sharing a head node do not collide)
#   RDZV_HOST       the head node's address, when `hostname --ip-address` there gives the wrong one
#   TORCHRUN        the torchrun executable (default: `torchrun` on PATH, else the repo's .venv)
#   MINGPT_REPO     the repository (default: the one this script was submitted from)
#   REQUEUE         1: when the time-limit warning comes (below), requeue the job once the training
#                   has saved its snapshot, so that it resumes from there when it runs again
#   STOP_GRACE      seconds torchrun gives its workers to save after a stop signal (default 110;
#                   keep it under the warning time)
#   GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME
#                   the network interface between the nodes (for example ens5), when the one each
#                   picks by itself is wrong: gloo takes the one of the address the node's hostname
#                   resolves to, NCCL an ib* one or else the first that is not loopback or docker.
#                   The training's start-up line "World: ..." names gloo's. See slurm/README.md,
#                   "Choosing the network interface".
#   REPLICA_GROUPS  1: a fault-tolerant run (torchft): each node one replica group, its own torchrun
#                   in its own job step, so that a lost node costs the others a step, not the run
#   MIN_REPLICA_GROUPS  with REPLICA_GROUPS=1: the fewest live groups that train (default 1)
#   LIGHTHOUSE_PORT with REPLICA_GROUPS=1: the lighthouse's port on the head node (default 29510 +
#                   job id % 1000)
#
# A training process that dies is restarted, with every other one, by torchrun (up to MAX_RESTARTS
# times) and resumes from the last snapshot. A node that dies ends the job; submit it again (or
# submit with --requeue) and it resumes from the snapshot, so keep the snapshot on storage every
# node shares (a shared file system or s3://).
#
# Stopping without losing work: Slurm sends this script SIGUSR1 two minutes before the time limit
# (--signal below; change it with sbatch --signal=B:USR1@SECONDS). The script then sends SIGTERM to
# the training, whose ranks agree on a step, save a snapshot there and exit; with REQUEUE=1 the job
# requeues itself and resumes from that snapshot. Preemption and scancel send SIGTERM to the
# training directly, with the same clean stop (Slurm requeues a preempted job submitted with
# --requeue by itself).
#
# One task per node: each task is a torchrun that starts NPROC_PER_NODE workers, so
# --ntasks-per-node must stay 1; --cpus-per-task is the CPUs of that node's torchrun and workers.
#SBATCH --job-name=mingpt-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=4
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120

set -euo pipefail

fail() {
    echo "sbatch_run.sh: error: $*" >&2
    exit 1
}

[ -n "${SLURM_JOB_ID:-}" ] || fail "not inside a Slurm job; submit it with: sbatch $0 [overrides]"

# sbatch runs a copy of this script from its spool directory, so $0 does not lead to the repo.
# Slurm remembers the submitted script's path; fall back to the submission directory.
find_repo() {
    if [ -n "${MINGPT_REPO:-}" ]; then
        echo "$MINGPT_REPO"
        return
    fi
    local script
    script=$(scontrol show job "$SLURM_JOB_ID" 2>/dev/null | sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n 1)
    if [ -n "$script" ] && [ -f "$(dirname "$script")/../mingpt/main.py" ]; then
        (cd "$(dirname "$script")/.." && pwd)
    else
        echo "${SLURM_SUBMIT_DIR:-$PWD}"
    fi
}
repo=$(find_repo)
main_py="$repo/mingpt/main.py"
[ -f "$main_py" ] || fail "no mingpt/main.py under $repo; set MINGPT_REPO to the repository"

# torchrun must be the one of the environment that has torch and the project's requirements.
if [ -n "${TORCHRUN:-}" ]; then
    torchrun=$TORCHRUN
elif command -v torchrun >/dev/null; then
    torchrun=$(command -v torchrun)
elif [ -x "$repo/.venv/bin/torchrun" ]; then
    torchrun="$repo/.venv/bin/torchrun"
else
    fail "no torchrun: activate the environment with torch before sbatch, or set TORCHRUN"
fi

# The first node of the allocation hosts the rendezvous; every node's torchrun meets there.
mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
head_node_ip=${RDZV_HOST:-$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')}
rdzv_port=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
# Unique per job, and per requeue of it, so that a rendezvous never joins a stale one.
rdzv_id="mingpt-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"

gpus_per_node=${SLURM_GPUS_ON_NODE:-0}
if [ -n "${NPROC_PER_NODE:-}" ]; then
    nproc_per_node=$NPROC_PER_NODE
elif [ "$gpus_per_node" -gt 0 ]; then
    nproc_per_node=$gpus_per_node
else
    nproc_per_node=1
fi

# Slurm 22.05's srun does not inherit --cpus-per-task from the batch job: pass it on. Without a
# thread count, each CPU worker would use every core of the node, not its share of the allocation.
cpus_per_task=${SLURM_CPUS_PER_TASK:-1}
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$(( cpus_per_task / nproc_per_node > 0 ? cpus_per_task / nproc_per_node : 1 ))}

# Restarts (MAX_RESTARTS) are unreliable when the workers share the rendezvous's TCP store: a
# restarted group often fails with "Gloo connectFullMesh failed" (pytorch issues 135712, 167288).
# With their own store they restart cleanly.
export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

echo "[mingpt-ddp] job $SLURM_JOB_ID: ${#nodes[@]} node(s) (${nodes[*]}), $nproc_per_node process(es) per node," \
     "$cpus_per_task CPU(s) and $gpus_per_node GPU(s) per node; rendezvous $rdzv_id at $head_node_ip:$rdzv_port"
echo "[mingpt-ddp] $main_py with $torchrun"

# Runs once on every node (one task per node): a line to say the node took part, then its
# torchrun, then a line with how torchrun ended there.
node_main() {
    local status=0
    echo "[mingpt-ddp] node $SLURMD_NODENAME ($(hostname)): node rank $SLURM_NODEID of $SLURM_NNODES starting torchrun"
    "$@" || status=$?
    echo "[mingpt-ddp] node $SLURMD_NODENAME: torchrun exited with status $status"
    return "$status"
}

# torchrun forwards the signals it handles to its workers, then waits --shutdown-timeout seconds
# before killing them: let it forward SIGUSR1 too (without a handler it would die at once and
# orphan its workers), and give the workers time to save. Older torchruns lack these options.
# (Asked once: each `torchrun --help` imports torch, seconds of the job's start.)
torchrun_help=$("$torchrun" --help 2>/dev/null || true)
stop_options=()
if grep -q -- "--signals-to-handle" <<< "$torchrun_help"; then
    stop_options+=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
fi
if grep -q -- "--shutdown-timeout" <<< "$torchrun_help"; then
    stop_options+=(--shutdown-timeout "${STOP_GRACE:-110}")
fi

# The time-limit warning (SIGUSR1, to this script only): ask every training process to stop. A
# signal through `scancel --signal` only signals; srun itself would cancel the step on SIGTERM.
warned=0
on_time_limit_warning() {
    warned=1
    echo "[mingpt-ddp] job $SLURM_JOB_ID: time limit near (SIGUSR1): asking the training to save and stop"
    scancel --signal=TERM "$SLURM_JOB_ID"
}
trap on_time_limit_warning USR1

# REPLICA_GROUPS=1: torchft's lighthouse here on the head node, then each node a replica group: its
# own step, with no --kill-on-bad-exit (one group's failure must not end the others; torchrun
# restarts its workers, which heal from the live groups), and its own torchrun (--standalone: the
# groups meet at the lighthouse, not at a rendezvous), its lines prefixed [replica g] here (the
# lowest live group speaks for the run; the others say their warnings, errors and healing). The run's
# own arguments come first: Hydra takes its options (--config-name) only before the overrides. Run in
# the background as srun is: the time-limit trap stays with this shell, and its
# `scancel --signal=TERM` reaches every step (not this shell's sed).
# The lighthouse is part of the run: when it ends before the groups, one line says so and every
# group is stopped as at the time-limit warning, with its snapshot (each would stop by itself at its
# next step, but torchrun would start it again against nothing); the job then ends with status 1.
ft_main() {
    local port=${LIGHTHOUSE_PORT:-$((29510 + SLURM_JOB_ID % 1000))} group tries=0 steps=() failed=()
    local lighthouse=("$(dirname "$torchrun")/torchft_lighthouse" --bind "$head_node_ip:$port"
                      --min_replicas "${MIN_REPLICA_GROUPS:-1}")
    RUST_LOG=${RUST_LOG:-warn} "${lighthouse[@]}" &
    lighthouse_pid=$!  # not local: the EXIT trap, which stops the lighthouse with this (sub)shell, reads it
    lighthouse_watch=""
    trap 'kill $lighthouse_watch 2>/dev/null; kill "$lighthouse_pid" 2>/dev/null && wait "$lighthouse_pid" || true' EXIT
    local address="http://$head_node_ip:$port"
    echo "[mingpt-ddp] Lighthouse: $address (pid $lighthouse_pid); if it dies, start it again on $head_node with:" \
         "${lighthouse[*]}, then restart the replica groups"
    until (exec 3<>"/dev/tcp/$head_node_ip/$port") 2>/dev/null; do  # answering, within a minute
        kill -0 "$lighthouse_pid" 2>/dev/null && [ $((tries += 1)) -le 300 ] || fail "no lighthouse at $address"
        sleep 0.2
    done
    for group in "${!nodes[@]}"; do
        echo "[mingpt-ddp] replica group $group on ${nodes[group]}: starting torchrun"
        srun --nodes=1 --ntasks=1 -w "${nodes[group]}" --cpus-per-task="$cpus_per_task" \
            "$torchrun" --standalone --nproc_per_node "$nproc_per_node" --max-restarts "${MAX_RESTARTS:-3}" \
            "${stop_options[@]}" "$main_py" "$@" fault_tolerance_config.enabled=true \
            "fault_tolerance_config.lighthouse=$address" "fault_tolerance_config.replica_groups=${#nodes[@]}" \
            "fault_tolerance_config.replica_group=$group" "fault_tolerance_config.min_replica_groups=${MIN_REPLICA_GROUPS:-1}" \
            2>&1 | sed -u "s/^/[replica $group] /" &  # pipefail: the pipeline's status is srun's
        steps+=($!)
    done
    (   # its own subshell: this one waits for the groups
        while kill -0 "$lighthouse_pid" 2>/dev/null; do sleep 1; done
        echo "[mingpt-ddp] error: the lighthouse (pid $lighthouse_pid) ended; no quorum forms without it, so" \
             "every replica group stops now with a snapshot; submit the job again to resume from it" >&2
        : > "$lighthouse_lost"
        scancel --signal=TERM "$SLURM_JOB_ID"
    ) &
    lighthouse_watch=$!
    for group in "${!steps[@]}"; do
        local status=0
        wait "${steps[group]}" || status=$?
        echo "[mingpt-ddp] replica group $group (${nodes[group]}): torchrun exited with status $status"
        [ "$status" = 0 ] || failed+=("$group")
    done
    kill "$lighthouse_watch" 2>/dev/null || true
    [ -e "$lighthouse_lost" ] && return 1  # said when it ended
    [ "${#failed[@]}" = 0 ] && return
    echo "[mingpt-ddp] job $SLURM_JOB_ID: replica group(s) ${failed[*]} failed after their restarts"
    [ "${#failed[@]}" -lt "${#nodes[@]}" ]
}

if [ "${REPLICA_GROUPS:-0}" = 1 ]; then
    lighthouse_lost=$(mktemp -u "${TMPDIR:-/tmp}/mingpt-lighthouse-lost.XXXXXX")  # made when it ends early
    ft_main "$@" &
else
    # --kill-on-bad-exit: when one node's torchrun gives up, stop the others rather than leave them
    # waiting for a rendezvous that will never complete.
    srun --nodes="${#nodes[@]}" --ntasks-per-node=1 --cpus-per-task="$cpus_per_task" --kill-on-bad-exit=1 \
        bash -c "$(declare -f node_main); node_main \"\$@\"" node_main \
        "$torchrun" \
        --nnodes "${#nodes[@]}" \
        --nproc_per_node "$nproc_per_node" \
        --rdzv_id "$rdzv_id" \
        --rdzv_backend c10d \
        --rdzv_endpoint "$head_node_ip:$rdzv_port" \
        --max-restarts "${MAX_RESTARTS:-3}" \
        "${stop_options[@]}" \
        "$main_py" "$@" &
fi
training=$!
# A trapped signal interrupts `wait`; wait again until the training has really ended.
status=0
while true; do
    wait "$training" && status=0 || status=$?
    kill -0 "$training" 2>/dev/null || break
done

rm -f "${lighthouse_lost:-}"

if [ "$warned" = 1 ] && [ "${REQUEUE:-0}" = 1 ]; then
    echo "[mingpt-ddp] job $SLURM_JOB_ID: requeued; it resumes from its snapshot when it runs again"
    scontrol requeue "$SLURM_JOB_ID"
    exit 0
fi
exit "$status"

# shellcheck shell=bash
# What slurm/sbatch_run.sh does beyond the original's lines, sourced by it (not run by itself): where
# main.py and torchrun are, the processes and threads per node, the rendezvous's port and id, the stop
# signals and the time-limit warning, the requeue, and fault-tolerant replica groups.
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
#   REQUEUE         1: when the time-limit warning comes, requeue the job once the training has
#                   saved its snapshot, so that it resumes from there when it runs again
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

fail() {
    echo "sbatch_run.sh: error: $*" >&2
    exit 1
}

# What the torchrun line needs besides the head node: main_py, torchrun, nproc_per_node,
# cpus_per_task, rdzv_port, rdzv_id and stop_options, and the workers' environment. A mistake is
# said before the job starts anything.
job_settings() {
    [ -n "${SLURM_JOB_ID:-}" ] || fail "not inside a Slurm job; submit it with: sbatch slurm/sbatch_run.sh [overrides]"
    # The repository holds these helpers (sbatch_run.sh found them beside the submitted script).
    local repo=${MINGPT_REPO:-$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)}
    main_py="$repo/mingpt/main.py"
    [ -f "$main_py" ] || fail "no mingpt/main.py under $repo; set MINGPT_REPO to the repository"
    # torchrun must be the one of the environment that has torch and the project's requirements.
    torchrun=${TORCHRUN:-$(command -v torchrun || echo "$repo/.venv/bin/torchrun")}
    [ -n "${TORCHRUN:-}" ] || [ -x "$torchrun" ] ||
        fail "no torchrun: activate the environment with torch before sbatch, or set TORCHRUN"

    rdzv_port=${RDZV_PORT:-$((29500 + SLURM_JOB_ID % 1000))}
    # Unique per job, and per requeue of it, so that a rendezvous never joins a stale one.
    rdzv_id="mingpt-$SLURM_JOB_ID-${SLURM_RESTART_COUNT:-0}"
    gpus_per_node=${SLURM_GPUS_ON_NODE:-0}
    nproc_per_node=${NPROC_PER_NODE:-$((gpus_per_node > 0 ? gpus_per_node : 1))}
    # Slurm 22.05's srun does not inherit --cpus-per-task from the batch job: pass it on. Without a
    # thread count, each CPU worker would use every core of the node, not its share of the allocation.
    cpus_per_task=${SLURM_CPUS_PER_TASK:-1}
    export OMP_NUM_THREADS=${OMP_NUM_THREADS:-$((cpus_per_task / nproc_per_node > 0 ? cpus_per_task / nproc_per_node : 1))}
    # Restarts (MAX_RESTARTS) are unreliable when the workers share the rendezvous's TCP store: a
    # restarted group often fails with "Gloo connectFullMesh failed" (pytorch issues 135712, 167288).
    # With their own store they restart cleanly.
    export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=${TORCH_DISABLE_SHARE_RDZV_TCP_STORE:-1}

    # torchrun forwards the signals it handles to its workers, then waits --shutdown-timeout seconds
    # before killing them: let it forward SIGUSR1 too (without a handler it would die at once and
    # orphan its workers), and give the workers time to save. Older torchruns lack these options.
    # (Asked once: each `torchrun --help` imports torch, seconds of the job's start.)
    local help
    help=$("$torchrun" --help 2>/dev/null || true)
    stop_options=()
    if grep -q -- "--signals-to-handle" <<< "$help"; then
        stop_options+=(--signals-to-handle "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1")
    fi
    if grep -q -- "--shutdown-timeout" <<< "$help"; then
        stop_options+=(--shutdown-timeout "${STOP_GRACE:-110}")
    fi
}

# Runs once on every node (one task per node): a line to say the node took part, then its
# torchrun, then a line with how torchrun ended there. srun starts it as with_node_lines.
node_main() {
    local status=0
    echo "[mingpt-ddp] node $SLURMD_NODENAME ($(hostname)): node rank $SLURM_NODEID of $SLURM_NNODES starting torchrun"
    "$@" || status=$?
    echo "[mingpt-ddp] node $SLURMD_NODENAME: torchrun exited with status $status"
    return "$status"
}
with_node_lines=(bash -c "$(declare -f node_main); node_main \"\$@\"" node_main)

# The time-limit warning (SIGUSR1, to the batch shell only: #SBATCH --signal=B:USR1@120): ask every
# training process to save and stop. A signal through `scancel --signal` only signals; srun itself
# would cancel the step on SIGTERM. Preemption and scancel send SIGTERM to the training directly.
warned=0
stop_on_time_limit() {
    warned=1
    echo "[mingpt-ddp] job $SLURM_JOB_ID: time limit near (SIGUSR1): asking the training to save and stop"
    scancel --signal=TERM "$SLURM_JOB_ID"
}

# Waits for the training (started in the background, so that the trap above runs at once), then
# with REQUEUE=1, after the warning, requeues the job: it resumes from its snapshot when it runs again.
wait_then_requeue() {
    local status=0
    while true; do  # a trapped signal interrupts `wait`: wait again until the training has really ended
        wait "$1" && status=0 || status=$?
        kill -0 "$1" 2>/dev/null || break
    done
    rm -f "$lighthouse_lost"
    if [ "$warned" = 1 ] && [ "${REQUEUE:-0}" = 1 ]; then
        echo "[mingpt-ddp] job $SLURM_JOB_ID: requeued; it resumes from its snapshot when it runs again"
        scontrol requeue "$SLURM_JOB_ID"
        exit 0
    fi
    exit "$status"
}

# REPLICA_GROUPS=1: torchft's lighthouse here on the head node, then each node a replica group: its
# own step, with no --kill-on-bad-exit (one group's failure must not end the others; torchrun
# restarts its workers, which heal from the live groups), and its own torchrun (--standalone: the
# groups meet at the lighthouse, not at a rendezvous), its lines prefixed [replica g] here (the
# lowest live group speaks for the run; the others say their warnings, errors and healing). The run's
# own arguments come first: Hydra takes its options (--config-name) only before the overrides. Run in
# the background as srun is: the time-limit trap stays with the batch shell, and its
# `scancel --signal=TERM` reaches every step (not this shell's sed).
# The lighthouse is part of the run: when it ends before the groups, one line says so and every
# group is stopped as at the time-limit warning, with its snapshot (each would stop by itself at its
# next step, but torchrun would start it again against nothing); the job then ends with status 1.
lighthouse_lost=$(mktemp -u "${TMPDIR:-/tmp}/mingpt-lighthouse-lost.XXXXXX")  # made when it ends early
replica_groups() {
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

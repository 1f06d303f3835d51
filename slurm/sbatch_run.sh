#!/usr/bin/env bash
# Multi-node training under Slurm, the original's script: one `torchrun` per node, c10d rendezvous
# at the head node.
#
#   sbatch slurm/sbatch_run.sh [hydra overrides ...]
#   sbatch --nodes=4 --gpus-per-node=8 --cpus-per-task=48 slurm/sbatch_run.sh \
#       trainer_config.snapshot_path=s3://bucket/gpt_snapshot.pt
#
# Options given to sbatch override the #SBATCH defaults below. No GPU is requested here: Slurm rejects
# a GPU request on nodes that have none, so ask for GPUs when you submit (`--gpus-per-node=8`). One
# task per node, a torchrun that starts the node's processes: keep --ntasks-per-node=1.
# Two minutes before the time limit Slurm warns this script (--signal), which asks the training to
# save and stop (REQUEUE=1: and requeues the job, which resumes there). The variables that tune a run
# (NPROC_PER_NODE, MAX_RESTARTS, RDZV_PORT, REQUEUE, REPLICA_GROUPS for fault tolerance, ...), and
# all that is done beyond the original's lines, are in sbatch_helpers.sh beside this script.
#SBATCH --job-name=mingpt-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=4
#SBATCH --output=slurm-%j.out
#SBATCH --open-mode=append
#SBATCH --signal=B:USR1@120

set -euo pipefail
# sbatch runs a copy of this script from its spool folder: the helpers lie beside the script that
# was submitted (Slurm keeps its path), beside this one when run by hand, or in the submission folder.
submitted=$(scontrol show job "${SLURM_JOB_ID:-none}" 2>/dev/null |
            sed -n 's/^ *Command=\([^ ]*\).*/\1/p' | head -n 1 || true)
for here in "$(dirname "${submitted:-/}")" "$(dirname "$0")" "${SLURM_SUBMIT_DIR:-.}/slurm"; do
    [ -f "$here/sbatch_helpers.sh" ] && break
done
# shellcheck source=sbatch_helpers.sh
source "$here/sbatch_helpers.sh"
job_settings  # main_py, torchrun, nproc_per_node, cpus_per_task, rdzv_port, rdzv_id, stop_options

mapfile -t nodes < <(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=${nodes[0]}
head_node_ip=${RDZV_HOST:-$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')}

echo "[mingpt-ddp] job $SLURM_JOB_ID: ${#nodes[@]} node(s) (${nodes[*]}), $nproc_per_node process(es)" \
     "per node, $cpus_per_task CPU(s) and $gpus_per_node GPU(s) per node;" \
     "rendezvous $rdzv_id at $head_node_ip:$rdzv_port"
echo "[mingpt-ddp] $main_py with $torchrun"

trap stop_on_time_limit USR1
if [ "${REPLICA_GROUPS:-0}" = 1 ]; then
    replica_groups "$@" &  # each node a replica group, meeting at torchft's lighthouse
else
    # --kill-on-bad-exit: when one node's torchrun gives up, stop the others rather than leave them
    # waiting for a rendezvous that will never complete.
    srun --nodes="${#nodes[@]}" --ntasks-per-node=1 --cpus-per-task="$cpus_per_task" --kill-on-bad-exit=1 \
        "${with_node_lines[@]}" "$torchrun" \
        --nnodes "${#nodes[@]}" \
        --nproc_per_node "$nproc_per_node" \
        --rdzv_id "$rdzv_id" \
        --rdzv_backend c10d \
        --rdzv_endpoint "$head_node_ip:$rdzv_port" \
        --max-restarts "${MAX_RESTARTS:-3}" \
        "${stop_options[@]}" \
        "$main_py" "$@" &
fi
wait_then_requeue $!

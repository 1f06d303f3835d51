#!/usr/bin/env bash
# Multi-node training under Slurm: one `torchrun` per node, c10d rendezvous at the head node.
#
#   sbatch slurm/sbatch_run.sh [hydra overrides ...]
#   sbatch --nodes=4 slurm/sbatch_run.sh trainer_config.snapshot_path=s3://bucket/gpt_snapshot.pt
#
# Processes per node: GPUS_PER_NODE (default: the GPUs Slurm gave the job, else CPU_WORKERS=1).
# Request GPUs at submission (`sbatch --gpus-per-node=8 ...`) only on nodes that have them:
# Slurm rejects a GPU request on a node without GPUs.
#SBATCH --job-name=mingpt-ddp
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --cpus-per-task=2
#SBATCH --output=slurm-%j.out

set -euo pipefail

nodes=$(scontrol show hostnames "$SLURM_JOB_NODELIST")
head_node=$(echo "$nodes" | head -n 1)
head_node_ip=$(srun --nodes=1 --ntasks=1 -w "$head_node" hostname --ip-address | awk '{print $1}')
gpus=${SLURM_GPUS_ON_NODE:-0}
nproc_per_node=${GPUS_PER_NODE:-$([ "$gpus" -gt 0 ] && echo "$gpus" || echo "${CPU_WORKERS:-1}")}
repo=${MINGPT_REPO:-${SLURM_SUBMIT_DIR:-$PWD}}

echo "nodes: $(echo $nodes) | head: $head_node ($head_node_ip) | processes per node: $nproc_per_node"

srun torchrun \
    --nnodes "$SLURM_NNODES" \
    --nproc_per_node "$nproc_per_node" \
    --rdzv_id "$SLURM_JOB_ID" \
    --rdzv_backend c10d \
    --rdzv_endpoint "$head_node_ip:${RDZV_PORT:-29500}" \
    --max-restarts "${MAX_RESTARTS:-3}" \
    "$repo/mingpt/main.py" "$@"

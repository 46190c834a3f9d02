#!/bin/bash
# torchrun-node.sh TORCHRUN-ARGS...   -- run by `srun` once on every node of the job.
#
# Starts torchrun for this node, after three things a bare `srun torchrun ...` gets wrong:
#
# 1. SIGUSR2 is ignored. `#SBATCH --signal=USR2@N` (without `B:`) and a preemption with
#    `preempt_send_user_signal` signal EVERY process of the job step: torchrun has no
#    handler for USR2, so it would die of it (`srun: error: nodeX: task N: User defined
#    signal 2`) and take its workers down before they could snapshot. An ignored signal
#    stays ignored through `exec`; the trainer's workers install their own handler.
# 2. --local-addr is this node's address on the training network, not whatever the
#    hostname resolves to (Debian's `127.0.1.1 hostname` line would make every peer dial
#    itself). Set ELASTIC_EXT_IFNAME=ib0 (or eth1, ...) to pick the interface; without
#    it the hostname's address is used, and a loopback answer is refused.
# 3. OMP_NUM_THREADS is the node's CPUs for this task divided among the local workers
#    (torchrun would otherwise set 1).
#
# Environment (all optional): ELASTIC_EXT_IFNAME, ELASTIC_EXT_LOCAL_ADDR (wins over
# the interface), ELASTIC_EXT_TORCHRUN (default: torchrun), OMP_NUM_THREADS (kept if set).
set -euo pipefail

trap '' USR2

log() { echo "[torchrun-node $(hostname) $(date +%T)] $*" >&2; }

nproc_per_node=1
for arg in "$@"; do
  case $arg in
    --nproc-per-node=*|--nproc_per_node=*) nproc_per_node=${arg#*=} ;;
  esac
done

addr=${ELASTIC_EXT_LOCAL_ADDR:-}
if [ -z "$addr" ] && [ -n "${ELASTIC_EXT_IFNAME:-}" ]; then
  addr=$(ip -4 -o addr show dev "$ELASTIC_EXT_IFNAME" 2>/dev/null | awk '{split($4, a, "/"); print a[1]; exit}')
  if [ -z "$addr" ]; then
    log "ELASTIC_EXT_IFNAME=$ELASTIC_EXT_IFNAME has no IPv4 address on this node"
    exit 2
  fi
  # gloo and NCCL pick their own interface; point them at the same one unless told otherwise.
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ELASTIC_EXT_IFNAME}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ELASTIC_EXT_IFNAME}
fi
if [ -z "$addr" ]; then
  addr=$(getent ahostsv4 "$(hostname)" | awk '{print $1; exit}')
fi
case $addr in
  "" | 127.*)
    log "this node's hostname resolves to '${addr:-nothing}', which other nodes cannot reach;" \
        "set ELASTIC_EXT_IFNAME to the interface of the training network (or ELASTIC_EXT_LOCAL_ADDR)"
    exit 2 ;;
esac

if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
  threads=$(( cpus / nproc_per_node ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

log "local address $addr, OMP_NUM_THREADS=$OMP_NUM_THREADS, restart ${SLURM_RESTART_COUNT:-0} of job ${SLURM_JOB_ID:-?}"
exec "${ELASTIC_EXT_TORCHRUN:-torchrun}" --local-addr="$addr" "$@"

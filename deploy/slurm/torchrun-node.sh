#!/bin/bash
# torchrun-node.sh TORCHRUN-ARGS...   -- run by `srun` once on every node of the job.
#
# Starts torchrun for this node, after three things a bare `srun torchrun ...` gets wrong:
#
# 1. SIGUSR2 is ignored until the etcd-ext plugin takes it. `#SBATCH --signal=USR2@N`
#    (without `B:`) and a preemption with `preempt_send_user_signal` signal EVERY process
#    of the job step: torchrun has no handler for USR2, so before the plugin loads it
#    would die of it (`srun: error: nodeX: task N: User defined signal 2`) and take its
#    workers down before they could snapshot. An ignored signal stays ignored through
#    `exec`; the plugin then records the notice for the workers (also those that start
#    later), and the trainer's workers install their own handler.
# 2. --local-addr is this node's address on the training network, not whatever the
#    hostname resolves to (Debian's `127.0.1.1 hostname` line would make every peer dial
#    itself). Set ELASTIC_EXT_IFNAME=ib0 (or eth1, ...) to pick the interface; without
#    it the hostname's address is used, and a loopback answer is refused.
# 3. OMP_NUM_THREADS is the node's CPUs for this task divided among the local workers
#    (torchrun would otherwise set 1).
#
# And it refuses to start torchrun (exit 2, one line naming the fix) when --nnodes does
# not fit the torchrun agents this srun step starts (SLURM_STEP_NUM_TASKS, one per node
# with --ntasks-per-node=1; outside a step SLURM_JOB_NUM_NODES, then SLURM_NNODES):
#   - missing (and no PET_NNODES): torchrun's default is 1:1, so every node would train
#     alone at world size 1 under the same run id;
#   - MAX below that count: the extra agents would never be admitted to a round;
#   - MIN above it: no round could ever close (the job would wait join_timeout, then fail).
# MIN <= agents <= MAX is accepted (a larger MAX leaves room for nodes that join later).
# Without any of those variables (not under SLURM) nothing is checked.
#
# Environment (all optional): ELASTIC_EXT_IFNAME, ELASTIC_EXT_LOCAL_ADDR (wins over
# the interface), ELASTIC_EXT_TORCHRUN (default: torchrun), OMP_NUM_THREADS (kept if set),
# ELASTIC_EXT_NODE_STEP=doctor (run `elastic-ext doctor` with the same line instead of
# torchrun; ELASTIC_EXT_DOCTOR_CMD, default "elastic-ext doctor", is what runs).
set -euo pipefail

trap '' USR2

log() { echo "[torchrun-node $(hostname) $(date +%T)] $*" >&2; }

# torchrun's own options, read as its argparse parser does: `--opt=value` or `--opt value`,
# unique prefixes of --nnodes (`--nn`...), up to the training script or `-m module`, whose
# arguments (the trainer's, which may have an --nnodes of their own) are not looked at.
# These options take no value; every other one takes one.
no_value=" -h --help --standalone -m --module --no-python --no_python --run-path --run_path \
--virtual-local-rank --virtual_local_rank "
nnodes=${PET_NNODES:-}
nnodes_given=${PET_NNODES:+PET_NNODES}
nproc_per_node=1
args=("$@")
i=0
while [ "$i" -lt ${#args[@]} ]; do
  arg=${args[$i]}
  i=$((i + 1))
  case $arg in
    --) break ;;
    --*=*) opt=${arg%%=*} value=${arg#*=} ;;
    -[!-]?*) opt=${arg:0:2} value=${arg:2} ;;  # -r3, -t3
    -*)
      opt=$arg value=
      case $no_value in
        *" $arg "*) ;;
        *) if [ "$i" -lt ${#args[@]} ]; then value=${args[$i]}; i=$((i + 1)); fi ;;
      esac ;;
    *) break ;;  # the training script
  esac
  case $opt in
    --nproc-per-node|--nproc_per_node) nproc_per_node=$value ;;
    --nn|--nno|--nnod|--nnode|--nnodes) nnodes=$value nnodes_given=$opt ;;
  esac
  case $opt in -m|--module) break ;; esac  # the next argument is the module
done
case $nproc_per_node in ''|*[!0-9]*|0) nproc_per_node=1 ;; esac  # auto, gpu, ...: one

agents='' agents_from=''
for var in SLURM_STEP_NUM_TASKS SLURM_JOB_NUM_NODES SLURM_NNODES; do
  if [ -n "${!var:-}" ]; then agents=${!var} agents_from=$var; break; fi
done
if [ -n "$agents" ]; then
  fix="pass --nnodes=MIN:MAX with MIN <= $agents <= MAX (elastic.sbatch passes"
  fix="$fix \$ELASTIC_EXT_MIN_NODES:\$SLURM_JOB_NUM_NODES)"
  counted="the $agents torchrun agents of this step ($agents_from=$agents)"
  if [ -z "$nnodes_given" ]; then
    log "--nnodes is missing: torchrun would take 1:1, so each torchrun agent of this step" \
        "($agents_from=$agents) would train alone at world size 1 under the same run id; $fix"
    exit 2
  fi
  if [[ $nnodes =~ ^([0-9]+)(:([0-9]+))?$ ]]; then
    min=$((10#${BASH_REMATCH[1]})) max=$((10#${BASH_REMATCH[3]:-${BASH_REMATCH[1]}}))
  else
    log "$nnodes_given=$nnodes is not N or MIN:MAX; $fix"
    exit 2
  fi
  if [ "$min" -lt 1 ] || [ "$min" -gt "$max" ]; then
    log "$nnodes_given=$nnodes is not a range (1 <= MIN <= MAX); $fix"
    exit 2
  fi
  if [ "$max" -lt "$agents" ]; then
    log "$nnodes_given=$nnodes does not match $counted: MAX $max < $agents would leave" \
        "$((agents - max)) of them out of every round; $fix"
    exit 2
  fi
  if [ "$min" -gt "$agents" ]; then
    log "$nnodes_given=$nnodes does not match $counted: MIN $min > $agents, no round could ever" \
        "start (the agents would wait join_timeout, then fail); $fix"
    exit 2
  fi
fi

# --local-addr: this node's address on the training network (node-addr.sh, shared with
# the job's etcd members).
. "$(dirname "${BASH_SOURCE[0]}")/node-addr.sh"
node_addr || exit 2
if [ -z "${ELASTIC_EXT_LOCAL_ADDR:-}" ] && [ -n "${ELASTIC_EXT_IFNAME:-}" ]; then
  # gloo and NCCL pick their own interface; point them at the same one unless told otherwise.
  export GLOO_SOCKET_IFNAME=${GLOO_SOCKET_IFNAME:-$ELASTIC_EXT_IFNAME}
  export NCCL_SOCKET_IFNAME=${NCCL_SOCKET_IFNAME:-$ELASTIC_EXT_IFNAME}
fi

if [ -z "${OMP_NUM_THREADS:-}" ]; then
  cpus=${SLURM_CPUS_PER_TASK:-${SLURM_CPUS_ON_NODE:-$(nproc)}}
  threads=$(( cpus / nproc_per_node ))
  export OMP_NUM_THREADS=$(( threads > 0 ? threads : 1 ))
fi

checked=${agents:+, $nnodes_given=$nnodes for $agents agents ($agents_from)}
if [ "${ELASTIC_EXT_NODE_STEP:-torchrun}" = doctor ]; then
  # the preflight (elastic.sbatch's first step): the same line, address and interface
  log "doctor on local address $addr"
  # shellcheck disable=SC2086  # ELASTIC_EXT_DOCTOR_CMD is a command and its arguments
  exec ${ELASTIC_EXT_DOCTOR_CMD:-elastic-ext doctor} --local-addr="$addr" "$@"
fi
log "local address $addr, OMP_NUM_THREADS=$OMP_NUM_THREADS, restart ${SLURM_RESTART_COUNT:-0} of job" \
    "${SLURM_JOB_ID:-?}$checked"
exec "${ELASTIC_EXT_TORCHRUN:-torchrun}" --local-addr="$addr" "$@"

#!/bin/bash
# etcd-member.sh addr | run PORT TOKEN CLUSTER  -- run by `srun` (elastic.sbatch) once on
# each node of the job that holds a member of the job's own etcd cluster.
#
#   addr  prints "NODE ADDRESS": this node's SLURM name and its address on the training
#         network (node-addr.sh: the address torchrun-node.sh gives torchrun as
#         --local-addr), so that elastic.sbatch can name every member to every other
#         before any of them starts.
#   run   this node's member: named after the node, client URL http://ADDRESS:PORT and
#         peer URL as CLUSTER (NAME=http://ADDRESS:PEER_PORT,...) names it for this node,
#         cluster token TOKEN (unique per job and restart), data in node-local scratch
#         (${TMPDIR:-/tmp}/elastic-ext-etcd-JOB-NODE.XXXXXX), removed when the member stops.
#
# The member stops, and removes its data, on TERM (scancel, the end of the job) and on
# USR1 (elastic.sbatch stops its etcd step with it: srun forwards USR1 to its tasks, but
# turns TERM into KILL, which would leave the data behind). USR2, a preemption notice, is
# ignored: the agents still need etcd to leave cleanly after their workers' snapshot.
set -euo pipefail

trap '' USR2

name=${SLURMD_NODENAME:-$(hostname -s)}
log() { echo "[etcd-member $name $(date +%T)] $*" >&2; }
. "$(dirname "${BASH_SOURCE[0]}")/node-addr.sh"

case ${1:-} in
  addr)
    node_addr || exit 2
    echo "$name $addr"
    ;;
  run)
    [ $# -eq 4 ] || { log "usage: etcd-member.sh run PORT TOKEN CLUSTER"; exit 2; }
    port=$2 token=$3 cluster=$4
    peer_url=$(tr ',' '\n' <<<"$cluster" | sed -n "s|^$name=||p" | head -n 1)
    if [ -z "$peer_url" ]; then
      log "this node is not a member of the job's etcd cluster $cluster"
      exit 2
    fi
    addr=${peer_url#http://}
    addr=${addr%:*}
    data=$(mktemp -d "${TMPDIR:-/tmp}/elastic-ext-etcd-${SLURM_JOB_ID:-0}-$name.XXXXXX")
    "${ELASTIC_EXT_ETCD_BIN:-etcd}" --name "$name" --data-dir "$data" --logger zap --log-level warn \
      --listen-client-urls "http://$addr:$port" --advertise-client-urls "http://$addr:$port" \
      --listen-peer-urls "$peer_url" --initial-advertise-peer-urls "$peer_url" \
      --initial-cluster "$cluster" --initial-cluster-token "$token" \
      --initial-cluster-state new < /dev/null &
    pid=$!
    # KILL, not TERM: the data goes with the member, so a graceful stop (a leader first
    # hands over, which takes seconds when the others stop too) would only risk slurm's
    # KILL after KillWait arriving before the data is removed.
    trap 'kill -KILL "$pid" 2>/dev/null || true; wait "$pid" 2>/dev/null || true; rm -rf "$data"' EXIT
    for sig in TERM USR1 INT HUP; do
      trap "log 'stopping on SIG$sig'; exit 0" "$sig"
    done
    log "member of $cluster, clients at http://$addr:$port, data in $data"
    status=0
    wait "$pid" || status=$?
    log "etcd exited with $status"
    exit "$status"
    ;;
  *)
    log "usage: etcd-member.sh addr | run PORT TOKEN CLUSTER"
    exit 2
    ;;
esac

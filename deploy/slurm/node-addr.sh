#!/bin/bash
# node-addr.sh -- sourced by torchrun-node.sh and etcd-member.sh (bash): this node's
# address on the training network, the one torchrun's --local-addr and the job's etcd
# member use, so that every node is named by the same address everywhere.
#
# node_addr sets `addr`: ELASTIC_EXT_LOCAL_ADDR, else the IPv4 address of
# ELASTIC_EXT_IFNAME, else what the hostname resolves to. A loopback answer (Debian's
# `127.0.1.1 hostname` line) is refused: other nodes cannot reach it. On a refusal it logs
# one line naming the fix (with the caller's `log`) and returns 2.
node_addr() {
  addr=${ELASTIC_EXT_LOCAL_ADDR:-}
  if [ -z "$addr" ] && [ -n "${ELASTIC_EXT_IFNAME:-}" ]; then
    addr=$(ip -4 -o addr show dev "$ELASTIC_EXT_IFNAME" 2>/dev/null \
           | awk '{split($4, a, "/"); print a[1]; exit}' || true)
    if [ -z "$addr" ]; then
      log "ELASTIC_EXT_IFNAME=$ELASTIC_EXT_IFNAME has no IPv4 address on this node"
      return 2
    fi
  fi
  if [ -z "$addr" ]; then
    addr=$(getent ahostsv4 "$(hostname)" | awk '{print $1; exit}' || true)
  fi
  case $addr in
    "" | 127.*)
      log "this node's hostname resolves to '${addr:-nothing}', which other nodes cannot reach;" \
          "set ELASTIC_EXT_IFNAME to the interface of the training network (or ELASTIC_EXT_LOCAL_ADDR)"
      return 2 ;;
  esac
}

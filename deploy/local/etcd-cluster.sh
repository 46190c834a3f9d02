#!/usr/bin/env bash
# etcd-cluster.sh start [1|3] | stop | status | endpoints
#
# A development etcd on loopback: one member, or three (to try what etcd-ext does when
# a member or the leader dies: `kill $(cat $DIR/m1.pid)`). Everything lives in one
# directory; `stop` ends the members it started (by their pid files) and deletes it.
#
#   deploy/local/etcd-cluster.sh start 3
#   torchrun ... --rdzv-backend=etcd-ext --rdzv-endpoint=$(deploy/local/etcd-cluster.sh endpoints) ...
#   deploy/local/etcd-cluster.sh stop
#
# Environment:
#   ELASTIC_EXT_ETCD_DIR   state directory (default ${XDG_RUNTIME_DIR:-/tmp}/elastic-ext-etcd-$USER)
#   ELASTIC_EXT_ETCD_PORT  first port (default 2379): member i listens for clients on PORT+2i
#                          and for peers on PORT+2i+1 (2379/2380, 2381/2382, 2383/2384)
#   ETCD                   the etcd binary (default: etcd on PATH, else /usr/bin/etcd)
set -euo pipefail

dir=${ELASTIC_EXT_ETCD_DIR:-${XDG_RUNTIME_DIR:-/tmp}/elastic-ext-etcd-${USER:-$(id -un)}}
base=${ELASTIC_EXT_ETCD_PORT:-2379}
etcd_bin=${ETCD:-$(command -v etcd || echo /usr/bin/etcd)}

die() { echo "etcd-cluster.sh: $*" >&2; exit 1; }

members() { # the member indexes this directory was started with
  [ -f "$dir/size" ] || return 0
  seq 0 $(( $(cat "$dir/size") - 1 ))
}

alive() { # pid file -> is that etcd still running?
  local pid
  [ -f "$1" ] || return 1
  pid=$(cat "$1")
  kill -0 "$pid" 2>/dev/null && grep -q etcd "/proc/$pid/cmdline" 2>/dev/null
}

healthy() { # client port -> does that member answer /health with true?
  local reply
  reply=$( { exec 3<>"/dev/tcp/127.0.0.1/$1" && printf 'GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n' >&3 \
             && timeout 2 cat <&3; } 2>/dev/null) || return 1
  [[ $reply == *'"health":"true"'* ]]
}

endpoints() {
  local out=() i
  for i in $(members); do out+=("127.0.0.1:$(( base + 2 * i ))"); done
  (IFS=,; echo "${out[*]}")
}

start() {
  local size=${1:-1} i cluster="" deadline
  case $size in 1|3) ;; *) die "size must be 1 or 3, not $size" ;; esac
  [ -x "$etcd_bin" ] || die "no etcd binary at $etcd_bin (Debian: apt-get install etcd-server)"
  if [ -f "$dir/size" ]; then
    for i in $(members); do alive "$dir/m$i.pid" && die "already running in $dir (stop it first)"; done
    rm -rf "$dir"   # a stale directory of a cluster that is gone
  fi
  mkdir -p "$dir"
  echo "$base" > "$dir/port"
  for i in $(seq 0 $(( size - 1 ))); do
    cluster+="${cluster:+,}m$i=http://127.0.0.1:$(( base + 2 * i + 1 ))"
  done
  echo "$size" > "$dir/size"
  for i in $(seq 0 $(( size - 1 ))); do
    local client=http://127.0.0.1:$(( base + 2 * i )) peer=http://127.0.0.1:$(( base + 2 * i + 1 ))
    # setsid: the member outlives this shell and gets no terminal signals (Ctrl-C)
    setsid "$etcd_bin" --name "m$i" --data-dir "$dir/m$i" \
      --listen-client-urls "$client" --advertise-client-urls "$client" \
      --listen-peer-urls "$peer" --initial-advertise-peer-urls "$peer" \
      --initial-cluster "$cluster" --initial-cluster-token "elastic-ext-dev-$base" \
      --initial-cluster-state new --logger zap --log-level warn \
      > "$dir/m$i.log" 2>&1 < /dev/null &
    echo $! > "$dir/m$i.pid"
  done
  deadline=$(( SECONDS + 30 ))
  for i in $(members); do
    until healthy $(( base + 2 * i )); do
      if ! alive "$dir/m$i.pid"; then
        tail -n 20 "$dir/m$i.log" >&2
        stop >/dev/null 2>&1 || true
        die "member m$i exited (log above)"
      fi
      if [ $SECONDS -ge $deadline ]; then
        stop >/dev/null 2>&1 || true
        die "member m$i not healthy after 30 s (ports $(( base + 2 * i ))/$(( base + 2 * i + 1 )) taken?)"
      fi
      sleep 0.2
    done
  done
  echo "etcd: $size member(s) healthy in $dir"
  echo "--rdzv-endpoint=$(endpoints)"
}

stop() {
  local i pid stopped=0
  [ -f "$dir/size" ] || { echo "nothing running in $dir"; return 0; }
  for i in $(members); do
    alive "$dir/m$i.pid" || continue
    pid=$(cat "$dir/m$i.pid")
    kill -TERM "$pid" 2>/dev/null || true
    for _ in $(seq 100); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
    if kill -0 "$pid" 2>/dev/null; then kill -KILL "$pid" 2>/dev/null || true; fi
    stopped=$(( stopped + 1 ))
  done
  rm -rf "$dir"
  echo "etcd: stopped $stopped member(s), removed $dir"
}

status() {
  local i up=0
  [ -f "$dir/size" ] || { echo "not running ($dir)"; return 1; }
  for i in $(members); do
    if alive "$dir/m$i.pid" && healthy $(( base + 2 * i )); then
      echo "m$i 127.0.0.1:$(( base + 2 * i )) healthy (pid $(cat "$dir/m$i.pid"))"; up=$(( up + 1 ))
    else
      echo "m$i 127.0.0.1:$(( base + 2 * i )) down"
    fi
  done
  [ $up -gt 0 ]
}

if [ "${1:-}" != start ] && [ -f "$dir/port" ]; then
  base=$(cat "$dir/port")  # a running cluster keeps the ports it started on
fi
case ${1:-} in
  start) start "${2:-1}" ;;
  stop) stop ;;
  status) status ;;
  endpoints) [ -f "$dir/size" ] || die "not running ($dir)"; endpoints ;;
  *) echo "usage: $0 start [1|3] | stop | status | endpoints" >&2; exit 2 ;;
esac

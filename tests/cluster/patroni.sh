#!/usr/bin/env bash
# Three PostgreSQL 15 nodes managed by Patroni, with a one-node etcd as Patroni's store and
# HAProxy in front routing to whichever node Patroni's REST API calls the primary, for the
# inbox's failover suite (tests/tests/db/patroni.rs). Everything runs on loopback, as the
# `postgres` user, under $PATRONI_DIR; `stop` ends only the processes whose pids this
# script recorded there (never the system server on 5432, MariaDB on 3306 or the other
# test clusters) and deletes the directory.
#
#   tests/cluster/patroni.sh start                 # idempotent; prints the URLs
#   tests/cluster/patroni.sh urls                  # stable (HAProxy),node1,node2,node3
#   tests/cluster/patroni.sh wait-healthy [secs]   # a leader, every other node streaming
#   tests/cluster/patroni.sh wait-new-leader OLD [secs]  # a running leader other than OLD
#   tests/cluster/patroni.sh leader                # the leader's name (node1..node3)
#   tests/cluster/patroni.sh sync-standby          # the synchronous standby's name
#   tests/cluster/patroni.sh kill-leader-postgres  # SIGKILL to the leader's postmaster, last WAL unsent
#   tests/cluster/patroni.sh switchover            # patronictl switchover to the sync standby
#   tests/cluster/patroni.sh stop-node NAME        # stops that node's Patroni (and its PostgreSQL)
#   tests/cluster/patroni.sh start-node NAME       # starts it again
#   tests/cluster/patroni.sh strict on|off         # synchronous_mode_strict, applied by the leader
#   tests/cluster/patroni.sh rewinds               # pg_rewind runs per node: node1=N ...
#   tests/cluster/patroni.sh list                  # patronictl list
#   tests/cluster/patroni.sh stop                  # stops everything, deletes the data
#
# What Patroni is told (bootstrap.dcs, the cluster-wide settings):
# - synchronous_mode: true. Patroni names one synchronous standby in
#   synchronous_standby_names (synchronous_commit stays `on`: a COMMIT returns once that
#   standby has flushed it), and promotes only that standby, so nothing a client saw
#   committed is lost in a failover.
# - primary_start_timeout: 0. When the leader's PostgreSQL dies but its Patroni lives,
#   Patroni fails over at once instead of restarting PostgreSQL in place for up to 300 s.
# - use_pg_rewind: true, with data checksums (initdb) and wal_log_hints: the old leader
#   rewinds its diverged timeline and rejoins as a replica instead of being recloned.
# - ttl 20 s (Patroni's minimum), loop_wait 1 s, retry_timeout 5 s: a loopback test's
#   values, far below the defaults (30, 10, 10). loop_wait bounds how long a crashed
#   PostgreSQL goes unnoticed; ttl only matters when a Patroni process itself dies (the
#   leader key then expires). Production keeps the defaults or tunes them to its network.
# - wal_keep_size: 512MB (more than a whole test run writes). After pg_rewind the old
#   leader replays from the last checkpoint the two timelines share, so the new leader
#   must still have the WAL from there on; its replication slot for the old leader is
#   newer than that. With 64MB the purge test's WAL outran it, and the old leader stayed
#   "starting" for good ("requested WAL segment ... has already been removed"), waiting
#   for a `patronictl reinit`. Production: wal_keep_size or a WAL archive with a
#   restore_command. checkpoint_timeout: 30s keeps that shared checkpoint recent, so the
#   rewind copies and the rejoin replays seconds of WAL, not minutes.
# - remove_data_directory_on_rewind_failure: true. When pg_rewind fails, Patroni's default
#   starts PostgreSQL on the unrewound data directory, which waits for WAL of a timeline
#   the leader never had and stays "starting" (patroni/patroni#3652); with it the node is
#   recloned from the leader instead. One CI run of 831732a saw the old leader stuck
#   "starting" for over 60 s after its PostgreSQL was killed; its log did not survive the
#   suite's stop, so which path it took is not known: wait-healthy now prints the log of
#   every member that is not running or streaming when it gives up.
#
# HAProxy (port base+8) checks every node's REST `OPTIONS /primary` every 500 ms (200 only
# on the node holding the leader key, with PostgreSQL running); two failures mark a node
# down and cut its sessions (on-marked-down shutdown-sessions), so no client keeps
# writing to a demoted node. In one kill run of 13, 6 transactions still met a node in
# recovery (SQLSTATE 25006) during the switch: nacked, redelivered, applied once.
#
# Ports, from $PATRONI_PORT_BASE (5450): etcd client +0, etcd peer +1, PostgreSQL +2..+4,
# Patroni REST +5..+7, HAProxy +8, HAProxy stats socket +9. Patroni (PyPI `patroni[etcd3]`
# and `psycopg2-binary`) lives in a virtual environment at $PATRONI_VENV, created when
# missing; etcd (Debian's etcd-server), HAProxy, jq and curl are installed when missing.
set -euo pipefail

# tmpfs when there is one: pg_rewind and initdb fsync every file they write, which takes
# seconds on a disk shared with compilers; the tests kill processes, never the machine.
if [[ -d /dev/shm ]]; then
    PATRONI_DIR=${PATRONI_DIR:-/dev/shm/inbox-patroni}
else
    PATRONI_DIR=${PATRONI_DIR:-/tmp/inbox-patroni}
fi
PATRONI_VENV=${PATRONI_VENV:-/opt/inbox-patroni-venv}
PATRONI_PORT_BASE=${PATRONI_PORT_BASE:-5450}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
NODES=(node1 node2 node3)

ETCD_PORT=$PATRONI_PORT_BASE
ETCD_PEER_PORT=$((PATRONI_PORT_BASE + 1))
PROXY_PORT=$((PATRONI_PORT_BASE + 8))
STATS_PORT=$((PATRONI_PORT_BASE + 9))
index_of() { echo $((${1#node} - 1)); }
pg_port() { echo $((PATRONI_PORT_BASE + 2 + $(index_of "$1"))); }
rest_port() { echo $((PATRONI_PORT_BASE + 5 + $(index_of "$1"))); }
url() { echo "postgres://postgres@127.0.0.1:$1/test"; }
die() {
    echo "patroni.sh: $*" >&2
    exit 1
}

# Runs "$@" as postgres, in a session of its own, detached from the caller's output, with
# its pid in $PATRONI_DIR/<name>.pid. setpriv execs (no forking wrapper), so the recorded
# pid is the process itself.
spawn() {
    local name=$1
    shift
    HOME=$PATRONI_DIR setsid setpriv --reuid=postgres --regid=postgres --init-groups -- "$@" \
        >>"$PATRONI_DIR/$name.log" 2>&1 </dev/null &
    echo $! >"$PATRONI_DIR/$name.pid"
}

# The pid recorded for <name> when that process is still alive and still ours (its
# command line names our directory, so a recycled pid is never signalled).
live_pid() {
    local file=$PATRONI_DIR/$1.pid pid
    [[ -f $file ]] || return 0
    pid=$(cat "$file")
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -q "$PATRONI_DIR"; then
        echo "$pid"
    fi
}

# Waits up to $2 seconds for pid $1 to exit; fails when it does not.
wait_exit() {
    local deadline=$((SECONDS + $2))
    while kill -0 "$1" 2>/dev/null; do
        ((SECONDS < deadline)) || return 1
        sleep 0.1
    done
}

install() {
    local missing=()
    command -v etcd >/dev/null || missing+=(etcd-server)
    command -v haproxy >/dev/null || missing+=(haproxy)
    command -v jq >/dev/null || missing+=(jq)
    command -v curl >/dev/null || missing+=(curl)
    command -v setpriv >/dev/null || missing+=(util-linux)
    [[ -x $PG_BIN/pg_rewind ]] || missing+=(postgresql-15)
    /usr/bin/python3 -c 'import venv, ensurepip' 2>/dev/null || missing+=(python3-venv)
    if ((${#missing[@]})); then
        apt-get update -qq
        DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
    fi
    if [[ ! -x $PATRONI_VENV/bin/patroni ]]; then
        rm -rf "$PATRONI_VENV"
        /usr/bin/python3 -m venv "$PATRONI_VENV"
        "$PATRONI_VENV/bin/pip" install -q --disable-pip-version-check 'patroni[etcd3]' psycopg2-binary
    fi
}

ports_free() {
    local port
    for port in $(seq "$PATRONI_PORT_BASE" $((PATRONI_PORT_BASE + 9))); do
        if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then
            die "port $port is taken; set PATRONI_PORT_BASE to a free range of 10 ports"
        fi
    done
}

# The cluster as Patroni's REST API describes it (`GET /cluster`), from the first node
# that answers; empty when none does.
cluster_json() {
    local node
    for node in "${NODES[@]}"; do
        if curl -sf --max-time 1 "http://127.0.0.1:$(rest_port "$node")/cluster" 2>/dev/null; then
            return 0
        fi
    done
}

member_with_role() {
    cluster_json | jq -r --arg role "$1" '[.members[] | select(.role == $role) | .name] | first // empty'
}
leader() { member_with_role leader; }
sync_standby() { member_with_role sync_standby; }

# Healthy: a running leader on the newest timeline, every other node streaming from it on
# that timeline, one of them the synchronous standby, and HAProxy sending to the leader
# alone.
healthy() {
    local json
    json=$(cluster_json)
    [[ -n $json ]] || return 1
    jq -e --argjson nodes "${#NODES[@]}" '
        (.members | length) == $nodes
        and ([.members[] | select(.role == "leader" and .state == "running")] | length) == 1
        and ([.members[] | select(.role != "leader" and .state == "streaming")] | length) == $nodes - 1
        and ([.members[] | select(.role == "sync_standby")] | length) == 1
        and ([.members[].timeline] | unique | length) == 1' <<<"$json" >/dev/null || return 1
    [[ $(proxy_up) == "$(jq -r '.members[] | select(.role == "leader") | .name' <<<"$json")" ]]
}

# The servers HAProxy's checks find up, space-separated.
proxy_up() {
    local reply
    reply=$(exec 3<>"/dev/tcp/127.0.0.1/$STATS_PORT" &&
        echo "show servers state postgres_primary" >&3 && cat <&3) || return 0
    awk '$4 ~ /^node/ && $6 == 2 { printf "%s%s", sep, $4; sep = " " }' <<<"$reply"
}

wait_healthy() {
    local timeout=${1:-60} started=$SECONDS node
    while ! healthy; do
        if ((SECONDS - started >= timeout)); then
            echo "patroni.sh: not healthy after $timeout s" >&2
            patronictl list >&2 || true
            echo "HAProxy sends to: $(proxy_up)" >&2
            # The log of each member that is neither leading nor streaming says why (its
            # PostgreSQL writes there too): the directory is gone after the suite stops.
            for node in $(cluster_json | jq -r '.members[] | select(.state != "running" and .state != "streaming") | .name'); do
                echo "--- the last 40 lines of $node.log" >&2
                tail -40 "$PATRONI_DIR/$node.log" >&2 || true
            done
            return 1
        fi
        sleep 0.2
    done
    echo "healthy after $((SECONDS - started)) s: leader $(leader), sync standby $(sync_standby)"
}

# Waits until a node other than $1 leads with PostgreSQL running, and HAProxy sends to it.
wait_new_leader() {
    local old=$1 timeout=${2:-60} started=$SECONDS new
    while :; do
        new=$(cluster_json | jq -r '[.members[] | select(.role == "leader" and .state == "running") | .name] | first // empty')
        if [[ -n $new && $new != "$old" && $(proxy_up) == "$new" ]]; then
            echo "$new"
            return
        fi
        ((SECONDS - started < timeout)) || die "no new leader after $timeout s"
        sleep 0.1
    done
}

patronictl() {
    HOME=$PATRONI_DIR setpriv --reuid=postgres --regid=postgres --init-groups -- \
        "$PATRONI_VENV/bin/patronictl" -c "$PATRONI_DIR/node1.yml" "$@"
}

write_node_config() {
    local node=$1
    cat >"$PATRONI_DIR/$node.yml" <<YAML
scope: inbox
name: $node
restapi:
  listen: 127.0.0.1:$(rest_port "$node")
  connect_address: 127.0.0.1:$(rest_port "$node")
etcd3:
  host: 127.0.0.1:$ETCD_PORT
bootstrap:
  dcs:
    ttl: 20
    loop_wait: 1
    retry_timeout: 5
    primary_start_timeout: 0
    maximum_lag_on_failover: 1048576
    synchronous_mode: true
    synchronous_mode_strict: false
    postgresql:
      use_pg_rewind: true
      use_slots: true
      parameters:
        wal_log_hints: 'on'
        max_connections: 100
        max_wal_senders: 10
        max_replication_slots: 10
        wal_keep_size: 512MB
        checkpoint_timeout: 30s
        shared_buffers: 32MB
  initdb:
    - encoding: UTF8
    - data-checksums
postgresql:
  listen: 127.0.0.1:$(pg_port "$node")
  connect_address: 127.0.0.1:$(pg_port "$node")
  data_dir: $PATRONI_DIR/$node
  bin_dir: $PG_BIN
  pgpass: $PATRONI_DIR/$node.pgpass
  authentication:
    superuser:
      username: postgres
    replication:
      username: postgres
    rewind:
      username: postgres
  remove_data_directory_on_rewind_failure: true
  parameters:
    unix_socket_directories: '$PATRONI_DIR'
  pg_hba:
    - local all all trust
    - host all all 127.0.0.1/32 trust
    - host replication all 127.0.0.1/32 trust
YAML
}

write_proxy_config() {
    local node
    cat >"$PATRONI_DIR/haproxy.cfg" <<CFG
global
    pidfile $PATRONI_DIR/haproxy.pid
    stats socket ipv4@127.0.0.1:$STATS_PORT level operator

defaults
    mode tcp
    timeout connect 2s
    timeout check 1s
    # Pools keep idle connections for minutes.
    timeout client 1h
    timeout server 1h
    retries 2
    option redispatch

listen postgres_primary
    bind 127.0.0.1:$PROXY_PORT
    # Patroni answers 200 on /primary only on the leader, with PostgreSQL running as a
    # primary; a replica, a demoted or a crashed node answers 503 (or nothing).
    option httpchk OPTIONS /primary
    http-check expect status 200
    default-server inter 500ms fall 2 rise 1 on-marked-down shutdown-sessions
CFG
    for node in "${NODES[@]}"; do
        echo "    server $node 127.0.0.1:$(pg_port "$node") check port $(rest_port "$node")" >>"$PATRONI_DIR/haproxy.cfg"
    done
}

start_node() {
    local node=$1
    [[ -n $(live_pid "$node") ]] && return 0
    spawn "$node" "$PATRONI_VENV/bin/patroni" "$PATRONI_DIR/$node.yml"
}

urls() {
    local out node
    out=$(url "$PROXY_PORT")
    for node in "${NODES[@]}"; do
        out+=",$(url "$(pg_port "$node")")"
    done
    echo "$out"
}

start() {
    if [[ -n $(live_pid etcd) ]] && healthy 2>/dev/null; then
        urls
        return
    fi
    stop
    local started=$SECONDS
    # Its output goes to stderr: stdout is the URLs.
    install >&2
    ports_free
    mkdir -p "$PATRONI_DIR"
    chown postgres:postgres "$PATRONI_DIR"
    chmod 700 "$PATRONI_DIR"

    spawn etcd etcd --name etcd1 --data-dir "$PATRONI_DIR/etcd" \
        --listen-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --advertise-client-urls "http://127.0.0.1:$ETCD_PORT" \
        --listen-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-advertise-peer-urls "http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster "etcd1=http://127.0.0.1:$ETCD_PEER_PORT" \
        --initial-cluster-state new
    local _
    for _ in $(seq 100); do
        curl -sf --max-time 1 "http://127.0.0.1:$ETCD_PORT/health" >/dev/null 2>&1 && break
        sleep 0.1
    done
    curl -sf --max-time 1 "http://127.0.0.1:$ETCD_PORT/health" >/dev/null ||
        { tail -5 "$PATRONI_DIR/etcd.log" >&2; die "etcd did not start"; }

    local node
    for node in "${NODES[@]}"; do
        write_node_config "$node"
        chown postgres:postgres "$PATRONI_DIR/$node.yml"
    done
    # node1 bootstraps alone first, so the others clone a running leader instead of
    # racing for the initialize key and waiting for the loser's retry.
    start_node node1
    for _ in $(seq 300); do
        [[ $(leader) == node1 ]] && break
        sleep 0.1
    done
    [[ $(leader) == node1 ]] || { tail -20 "$PATRONI_DIR/node1.log" >&2; die "node1 did not bootstrap"; }
    start_node node2
    start_node node3

    write_proxy_config
    haproxy -D -f "$PATRONI_DIR/haproxy.cfg" 2>>"$PATRONI_DIR/haproxy.log"
    if ! wait_healthy 120 >/dev/null; then
        tail -5 "$PATRONI_DIR"/*.log >&2 || true
        die "the Patroni cluster did not come up; logs in $PATRONI_DIR"
    fi
    "$PG_BIN/psql" -h 127.0.0.1 -p "$PROXY_PORT" -U postgres -d postgres -qAtc 'CREATE DATABASE test' >/dev/null
    echo "patroni.sh: 3 nodes (leader $(leader), sync standby $(sync_standby)) up in $((SECONDS - started)) s" >&2
    urls
}

stop_postgres() {
    local node=$1 pid
    [[ -f $PATRONI_DIR/$node/postmaster.pid ]] || return 0
    pid=$(head -1 "$PATRONI_DIR/$node/postmaster.pid")
    if kill -0 "$pid" 2>/dev/null; then
        setpriv --reuid=postgres --regid=postgres --init-groups -- \
            "$PG_BIN/pg_ctl" -D "$PATRONI_DIR/$node" -m immediate -w stop >/dev/null 2>&1 || true
        wait_exit "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true
    fi
}

stop() {
    [[ -d $PATRONI_DIR ]] || return 0
    local pid node
    pid=$([[ -f $PATRONI_DIR/haproxy.pid ]] && cat "$PATRONI_DIR/haproxy.pid" || true)
    if [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null && grep -q haproxy "/proc/$pid/comm" 2>/dev/null; then
        kill "$pid"
        wait_exit "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true
    fi
    # Patroni first, so that none restarts a PostgreSQL stopped below; then PostgreSQL
    # (its postmaster runs in a session of its own), then etcd.
    for node in "${NODES[@]}"; do
        pid=$(live_pid "$node")
        if [[ -n $pid ]]; then
            kill -KILL "$pid"
            wait_exit "$pid" 10 || true
        fi
    done
    for node in "${NODES[@]}"; do
        stop_postgres "$node"
    done
    pid=$(live_pid etcd)
    if [[ -n $pid ]]; then
        kill "$pid"
        wait_exit "$pid" 10 || kill -KILL "$pid" 2>/dev/null || true
    fi
    rm -rf "$PATRONI_DIR"
    # Everything this script starts names the directory on its command line (etcd,
    # Patroni, the postmasters; a backend dies with its postmaster).
    local left
    left=$(pgrep -a -f -- "$PATRONI_DIR" || true)
    if [[ -n $left ]]; then
        echo "patroni.sh: still running after stop:" >&2
        echo "$left" >&2
        return 1
    fi
}

stop_node() {
    local node=$1 pid
    pid=$(live_pid "$node")
    [[ -n $pid ]] || die "$node's Patroni is not running"
    # SIGTERM: Patroni stops its PostgreSQL (fast shutdown) and leaves the cluster.
    kill -TERM "$pid"
    if ! wait_exit "$pid" 60; then
        kill -KILL "$pid" 2>/dev/null || true
        stop_postgres "$node"
    fi
    echo "stopped $node"
}

# SIGKILL to the leader's postmaster, with the tail of its WAL never sent: its walsenders
# are frozen (SIGSTOP) for $PATRONI_UNSENT_MS ms first, so the commits made meanwhile are
# written to the leader's WAL but reach no standby (their clients wait, unacked, for the
# synchronous standby). The old leader's timeline then diverges from the promoted
# standby's, and it can rejoin only through pg_rewind. The walsenders are killed after the
# postmaster (a stopped process still dies of SIGKILL).
kill_leader_postgres() {
    local node pid senders
    node=$(leader)
    [[ -n $node ]] || die "no leader"
    pid=$(head -1 "$PATRONI_DIR/$node/postmaster.pid")
    senders=$(ps --ppid "$pid" -o pid=,args= | awk '/walsender/ { print $1 }' | tr '\n' ' ')
    [[ -z $senders ]] || kill -STOP $senders
    sleep "$(awk -v ms="${PATRONI_UNSENT_MS:-300}" 'BEGIN { print ms / 1000 }')"
    kill -KILL "$pid"
    [[ -z $senders ]] || kill -KILL $senders 2>/dev/null || true
    echo "killed $node's postmaster (pid $pid) and its walsenders (${senders% })"
}

switchover() {
    local from to
    from=$(leader)
    to=$(sync_standby)
    [[ -n $from && -n $to ]] || die "a switchover needs a leader and a synchronous standby"
    patronictl switchover --leader "$from" --candidate "$to" --force >"$PATRONI_DIR/switchover.log" 2>&1 ||
        { cat "$PATRONI_DIR/switchover.log" >&2; die "patronictl switchover failed"; }
    echo "switched over from $from to $to"
}

# Sets synchronous_mode_strict and waits until the leader's synchronous_standby_names
# reflects the cluster's configuration (Patroni applies it in its next loop).
strict() {
    local value
    case ${1:-} in
    on) value=true ;;
    off) value=false ;;
    *) die "usage: $0 strict on|off" ;;
    esac
    patronictl edit-config --set "synchronous_mode_strict=$value" --force >/dev/null
    local _
    for _ in $(seq 100); do
        if [[ $(curl -sf --max-time 1 "http://127.0.0.1:$(rest_port "$(leader)")/config" |
            jq -r '.synchronous_mode_strict // false') == "$value" ]]; then
            echo "synchronous_mode_strict = $value"
            return
        fi
        sleep 0.1
    done
    die "synchronous_mode_strict did not become $value"
}

# "node1=N node2=N node3=N": the pg_rewind runs that succeeded on each node so far.
rewinds() {
    local node out=()
    for node in "${NODES[@]}"; do
        out+=("$node=$(grep -c 'pg_rewind exit code=0' "$PATRONI_DIR/$node.log" 2>/dev/null || true)")
    done
    echo "${out[*]}"
}

node_arg() {
    [[ ${1:-} =~ ^node[123]$ ]] || die "name a node: node1, node2 or node3"
    echo "$1"
}

case ${1:-} in
start) start ;;
stop) stop ;;
urls) urls ;;
wait-healthy) wait_healthy "${2:-60}" ;;
wait-new-leader) wait_new_leader "$(node_arg "${2:-}")" "${3:-60}" ;;
leader) leader ;;
sync-standby) sync_standby ;;
kill-leader-postgres) kill_leader_postgres ;;
switchover) switchover ;;
stop-node) stop_node "$(node_arg "${2:-}")" ;;
start-node)
    start_node "$(node_arg "${2:-}")"
    echo "started $2"
    ;;
strict) strict "${2:-}" ;;
rewinds) rewinds ;;
list) patronictl list ;;
*)
    echo "usage: $0 start|stop|urls|wait-healthy [secs]|wait-new-leader OLD [secs]|leader|sync-standby|kill-leader-postgres|switchover|stop-node NAME|start-node NAME|strict on|off|rewinds|list" >&2
    exit 2
    ;;
esac

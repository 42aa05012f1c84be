#!/usr/bin/env bash
# PgBouncer (Debian's 1.18) in transaction pooling mode in front of the system PostgreSQL on
# 5432, for the inbox's pooler tests. Its config, pid and log live in $PGBOUNCER_DIR; it runs
# as the `postgres` user (PgBouncer refuses root) and stop kills only the pid it wrote.
#
#   tests/cluster/pgbouncer.sh start   # idempotent; prints the URL
#   tests/cluster/pgbouncer.sh stop
#   tests/cluster/pgbouncer.sh url     # postgres://postgres@127.0.0.1:6432/test
#
# Every database name is routed to the server (`* =`), so the tests' per-test databases
# created through it are reachable through it too.
set -euo pipefail

PGBOUNCER_DIR=${PGBOUNCER_DIR:-/tmp/inbox-pgbouncer}
PGBOUNCER_PORT=${PGBOUNCER_PORT:-6432}
UPSTREAM_HOST=${PGBOUNCER_UPSTREAM_HOST:-127.0.0.1}
UPSTREAM_PORT=${PGBOUNCER_UPSTREAM_PORT:-5432}

DAEMON_NAME=pgbouncer
DAEMON_DIR=$PGBOUNCER_DIR

# shellcheck source=tests/cluster/daemon.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemon.sh"

# The port is fixed and PgBouncer puts itself in the background (-d, writing PID_FILE):
# url and start are this script's own.
url() { echo "postgres://postgres@127.0.0.1:$PGBOUNCER_PORT/test"; }

write_config() {
    mkdir -p "$PGBOUNCER_DIR"
    cat >"$PGBOUNCER_DIR/pgbouncer.ini" <<INI
[databases]
* = host=$UPSTREAM_HOST port=$UPSTREAM_PORT

[pgbouncer]
listen_addr = 127.0.0.1
listen_port = $PGBOUNCER_PORT
unix_socket_dir = $PGBOUNCER_DIR
pidfile = $PID_FILE
logfile = $LOG
auth_type = trust
auth_file = $PGBOUNCER_DIR/userlist.txt
admin_users = postgres
pool_mode = transaction
; Fewer server connections than the tests' client connections, so clients really share them.
default_pool_size = 8
max_client_conn = 1000
; sqlx (0.9) gives every prepared statement a name (sqlx_s_1, sqlx_s_2, ...) per client
; connection, even with its statement cache off. Dropping them when a server connection goes
; back to the pool keeps one client's names from meeting another client's on that server.
server_reset_query = DEALLOCATE ALL
server_reset_query_always = 1
; sqlx sends extra_float_digits at startup, which PgBouncer does not track.
ignore_startup_parameters = extra_float_digits
INI
    echo '"postgres" ""' >"$PGBOUNCER_DIR/userlist.txt"
    chown -R postgres:postgres "$PGBOUNCER_DIR"
}

start() {
    if running; then
        url
        return
    fi
    command -v pgbouncer >/dev/null || "$(dirname "$0")/install-pg.sh"
    write_config
    runuser -u postgres -- pgbouncer -d "$PGBOUNCER_DIR/pgbouncer.ini"
    for _ in $(seq 50); do
        if psql -h 127.0.0.1 -p "$PGBOUNCER_PORT" -U postgres -d test -Atc 'SELECT 1' >/dev/null 2>&1; then
            url
            return
        fi
        sleep 0.1
    done
    echo "pgbouncer did not answer on port $PGBOUNCER_PORT; log:" >&2
    tail -20 "$LOG" >&2 || true
    exit 1
}

daemon_main "$@"

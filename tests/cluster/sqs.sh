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
# The version the guide's notes on moto's differences from SQS were checked against.
MOTO_VERSION=5.2.5

DAEMON_NAME=moto
DAEMON_DIR=$SQS_DIR
DAEMON_START_TRIES=300

# Prints the path of the Python that has moto_server, installing it into the cache if it
# is not there yet.
daemon_bin() {
    local venv=$SQS_CACHE/venv
    if [[ -x $venv/bin/moto_server ]] &&
        [[ $("$venv/bin/python" -c 'import moto; print(moto.__version__)' 2>/dev/null) == "$MOTO_VERSION" ]]; then
        echo "$venv/bin/python"
        return
    fi
    mkdir -p "$SQS_CACHE"
    echo "installing moto[server] $MOTO_VERSION into $venv" >&2
    venv_install "$venv" "moto[server]==$MOTO_VERSION"
    echo "$venv/bin/python"
}

# moto_server through moto_serialized.py: its SQS backend one call at a time (moto's own
# races otherwise deliver a message twice, or bring a deleted one back; see the script).
daemon_args() {
    DAEMON_ARGS=("$(dirname "${BASH_SOURCE[0]}")/moto_serialized.py" -H 127.0.0.1 -p "$1")
}

daemon_address() { echo "http://127.0.0.1:$1"; }

# shellcheck source=tests/cluster/daemon.sh
source "$(dirname "${BASH_SOURCE[0]}")/daemon.sh"
daemon_main "$@"

# Sourced by the scripts that run one local server for a test suite (kafka.sh, sqs.sh,
# pgbouncer.sh, pg18.sh): the pid and port files, the free port, the start that waits for
# the port, the stop that kills only the pid it wrote, and the start|stop|url command line
# they share.
#
# Before sourcing, the script sets DAEMON_NAME (the server's name in messages and file
# names), DAEMON_DIR (where its pid, port and log files go) and DAEMON_START_TRIES (tenths
# of a second to wait for the port), and defines
#   daemon_bin              prints the server binary's path, installing it if need be;
#   daemon_args PORT        sets the array DAEMON_ARGS to the binary's arguments;
#   daemon_address PORT     prints the address a client is given.
# Then it calls `daemon_main "$@"`.
#
# A server that puts itself in the background on a fixed port (pgbouncer.sh: PgBouncer's
# -d; pg18.sh: pg_ctl) gets its own start and url instead: the script defines them after
# sourcing this file, and its start writes PID_FILE. It shares running, stop and the
# command line, and may set DAEMON_STOP_SIGNAL (default TERM) and DAEMON_STOP_TRIES (tenths
# of a second to wait for the exit, default 50), and define daemon_cleanup, which stop runs
# once the server is gone.

PID_FILE=$DAEMON_DIR/$DAEMON_NAME.pid
PORT_FILE=$DAEMON_DIR/$DAEMON_NAME.port
LOG=$DAEMON_DIR/$DAEMON_NAME.log

running() { [[ -f $PID_FILE ]] && kill -0 "$(cat "$PID_FILE")" 2>/dev/null; }

url() {
    if ! running; then
        echo "$DAEMON_NAME is not running (start it with $0 start)" >&2
        exit 1
    fi
    daemon_address "$(cat "$PORT_FILE")"
}

# Creates the virtual environment VENV and pip installs the remaining arguments into it,
# its output on stderr (stdout is the address the caller captures).
venv_install() {
    local venv=$1
    shift
    python3 -m venv "$venv" >&2 && "$venv/bin/pip" install --quiet "$@" >&2
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
    bin=$(daemon_bin)
    mkdir -p "$DAEMON_DIR"
    port=$(free_port)
    echo "$port" >"$PORT_FILE"
    daemon_args "$port"
    # setsid: the server outlives this script and its terminal; stop kills it by its pid.
    setsid "$bin" "${DAEMON_ARGS[@]}" </dev/null >"$LOG" 2>&1 &
    echo $! >"$PID_FILE"
    for _ in $(seq "$DAEMON_START_TRIES"); do
        if port_open "$port"; then
            url
            return
        fi
        running || break
        sleep 0.1
    done
    echo "$DAEMON_NAME did not accept connections on 127.0.0.1:$port; log:" >&2
    tail -20 "$LOG" >&2 || true
    stop
    exit 1
}

stop() {
    if running; then
        local pid
        pid=$(cat "$PID_FILE")
        kill -"${DAEMON_STOP_SIGNAL:-TERM}" "$pid"
        for _ in $(seq "${DAEMON_STOP_TRIES:-50}"); do
            kill -0 "$pid" 2>/dev/null || break
            sleep 0.1
        done
    fi
    rm -f "$PID_FILE" "$PORT_FILE"
    if declare -F daemon_cleanup >/dev/null; then
        daemon_cleanup
    fi
}

daemon_main() {
    case ${1:-} in
    start) start ;;
    stop) stop ;;
    url) url ;;
    *)
        echo "usage: $0 start|stop|url" >&2
        exit 2
        ;;
    esac
}

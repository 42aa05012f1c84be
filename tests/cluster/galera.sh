#!/usr/bin/env bash
# A 3-node MariaDB Galera cluster on loopback, for the Galera test suite.
#
#   galera.sh start       start the cluster (idempotent: a running, synced cluster is kept)
#   galera.sh stop        stop every node and remove the cluster's directory
#   galera.sh kill N      kill -9 node N (1-3): a crash, no goodbye to the group
#   galera.sh restart N   restart node N after a crash; it rejoins by IST
#   galera.sh urls        print the three nodes' mysql:// URLs, comma-separated
#   galera.sh status      print each node's wsrep state
#
# Each node is a separate mariadbd with its own data directory under $INBOX_GALERA_DIR
# (default /tmp/inbox-galera). Node N listens for SQL on 4305+N, for the group on
# 4567+10(N-1) (IST on the next port) and for rsync state transfers on 4443+N. The script
# only ever signals the process ids it recorded itself: the system MariaDB on 3306 is never
# touched.
set -euo pipefail

BASE=${INBOX_GALERA_DIR:-/tmp/inbox-galera}
NODES=(1 2 3)
PROVIDER=/usr/lib/galera/libgalera_smm.so
MARIADBD=$(command -v mariadbd || echo /usr/sbin/mariadbd)
INSTALL_DB=$(command -v mariadb-install-db || echo /usr/bin/mariadb-install-db)
# As root the nodes run as mysql: the rsync daemon of a state transfer drops root to
# nobody, which could not write a root-owned data directory.
if [[ $(id -u) == 0 ]]; then RUN_AS=mysql; else RUN_AS=$(id -un); fi

sql_port() { echo $((4305 + $1)); }
group_port() { echo $((4567 + 10 * ($1 - 1))); }
sst_port() { echo $((4443 + $1)); }
node_dir() { echo "$BASE/node$1"; }
pid_file() { echo "$(node_dir "$1")/node.pid"; }
log_file() { echo "$(node_dir "$1")/error.log"; }
socket() { echo "$(node_dir "$1")/mysqld.sock"; }

die() {
  echo "galera: $*" >&2
  exit 1
}

check_node() {
  [[ ${1:-} =~ ^[123]$ ]] || die "node must be 1, 2 or 3, not '${1:-}'"
}

# The recorded pid of node N if that process is still a mariadbd; empty otherwise.
node_pid() {
  local file pid
  file=$(pid_file "$1")
  [[ -f $file ]] || return 0
  pid=$(<"$file")
  if [[ -n $pid && -r /proc/$pid/comm && $(</proc/"$pid"/comm) == mariadbd ]]; then
    echo "$pid"
  fi
}

client() { # node, mariadb client arguments...
  local node=$1
  shift
  mariadb --no-defaults --protocol=socket -S "$(socket "$node")" -uroot -N -B "$@"
}

wsrep_state() {
  client "$1" -e "SHOW STATUS LIKE 'wsrep_local_state_comment'" 2>/dev/null | awk '{print $2}'
}

cluster_size() {
  client "$1" -e "SHOW STATUS LIKE 'wsrep_cluster_size'" 2>/dev/null | awk '{print $2}'
}

write_config() {
  local n=$1 dir members=""
  dir=$(node_dir "$n")
  for m in "${NODES[@]}"; do
    members+="${members:+,}127.0.0.1:$(group_port "$m")"
  done
  # evs timeouts of a few seconds: a killed node stalls the writers on the others for about
  # 3 s instead of the default 6-10 s (keepalive <= check period <= suspect <= inactive).
  cat >"$dir/my.cnf" <<EOF
[mysqld]
user=$RUN_AS
datadir=$dir/data
socket=$(socket "$n")
pid-file=$dir/mariadbd.pid
log-error=$(log_file "$n")
bind-address=127.0.0.1
port=$(sql_port "$n")
skip-name-resolve
performance_schema=OFF
innodb_buffer_pool_size=64M
innodb_log_file_size=32M
innodb_flush_log_at_trx_commit=2
binlog_format=ROW
default_storage_engine=InnoDB
innodb_autoinc_lock_mode=2
character_set_server=utf8mb4
collation_server=utf8mb4_general_ci
max_connections=300
wsrep_on=ON
wsrep_provider=$PROVIDER
wsrep_cluster_name=inbox_galera
wsrep_cluster_address=gcomm://$members
wsrep_node_name=node$n
wsrep_node_address=127.0.0.1:$(group_port "$n")
wsrep_node_incoming_address=127.0.0.1:$(sql_port "$n")
wsrep_sst_method=rsync
wsrep_sst_receive_address=127.0.0.1:$(sst_port "$n")
wsrep_slave_threads=2
wsrep_provider_options="gmcast.listen_addr=tcp://127.0.0.1:$(group_port "$n");ist.recv_addr=127.0.0.1:$(($(group_port "$n") + 1));gcache.size=32M;evs.keepalive_period=PT0.5S;evs.inactive_check_period=PT0.5S;evs.suspect_timeout=PT2S;evs.inactive_timeout=PT3S;evs.install_timeout=PT3S;pc.wait_prim_timeout=PT30S"
EOF
}

launch() { # node, extra mariadbd arguments...
  local n=$1
  shift
  # setsid: the node leads its own process group, so stop also ends its state-transfer
  # helpers (rsync, socat) and nothing else.
  setsid "$MARIADBD" --defaults-file="$(node_dir "$n")/my.cnf" "$@" \
    </dev/null >>"$(log_file "$n")" 2>&1 &
  local pid=$! tries=0
  # Record the pid once the forked shell has become mariadbd, so node_pid can tell it
  # from a recycled pid.
  while [[ $(cat /proc/"$pid"/comm 2>/dev/null) != mariadbd ]]; do
    ((++tries < 100)) || die "node $n did not start; see $(log_file "$n")"
    sleep 0.05
  done
  echo "$pid" >"$(pid_file "$n")"
}

wait_synced() { # node, seconds
  local n=$1 deadline=$((SECONDS + $2))
  while ((SECONDS < deadline)); do
    [[ -n $(node_pid "$n") ]] || die "node $n exited while starting; see $(log_file "$n")"
    if [[ $(wsrep_state "$n") == Synced ]]; then
      return 0
    fi
    sleep 0.3
  done
  tail -n 30 "$(log_file "$n")" >&2 || true
  die "node $n did not reach Synced within $2 s; see $(log_file "$n")"
}

all_synced() {
  for n in "${NODES[@]}"; do
    [[ -n $(node_pid "$n") && $(wsrep_state "$n") == Synced && $(cluster_size "$n") == 3 ]] || return 1
  done
}

start() {
  if all_synced 2>/dev/null; then
    echo "galera: already running"
    return 0
  fi
  "$(dirname "$0")/install.sh"
  stop_nodes
  rm -rf "$BASE"
  local started=$SECONDS
  for n in "${NODES[@]}"; do
    mkdir -p "$(node_dir "$n")/data"
    write_config "$n"
  done
  chown -R "$RUN_AS" "$BASE"
  # Only the first node is initialised: the others receive its data by state transfer.
  "$INSTALL_DB" --defaults-file="$(node_dir 1)/my.cnf" --user="$RUN_AS" --auth-root-authentication-method=normal \
    --skip-test-db >"$(node_dir 1)/install.log" 2>&1 ||
    die "mariadb-install-db failed; see $(node_dir 1)/install.log"
  launch 1 --wsrep-new-cluster
  wait_synced 1 60
  client 1 -e "CREATE USER IF NOT EXISTS 'root'@'127.0.0.1';
    GRANT ALL PRIVILEGES ON *.* TO 'root'@'127.0.0.1' WITH GRANT OPTION;
    CREATE DATABASE IF NOT EXISTS test;"
  # One joiner at a time: a donor serves one state transfer at once.
  for n in 2 3; do
    launch "$n"
    wait_synced "$n" 90
  done
  echo "galera: 3 nodes synced in $((SECONDS - started)) s: $(urls)"
}

stop_nodes() {
  local pids=() n pid
  for n in "${NODES[@]}"; do
    pid=$(node_pid "$n")
    if [[ -n $pid ]]; then
      kill -TERM -- "-$pid" 2>/dev/null || kill -TERM "$pid" 2>/dev/null || true
      pids+=("$pid")
    fi
  done
  local deadline=$((SECONDS + 30))
  for pid in "${pids[@]}"; do
    while kill -0 "$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 0.2; done
    kill -KILL -- "-$pid" 2>/dev/null || true
  done
}

stop() {
  stop_nodes
  rm -rf "$BASE"
  echo "galera: stopped"
}

kill_node() {
  check_node "$1"
  local pid
  pid=$(node_pid "$1")
  [[ -n $pid ]] || die "node $1 is not running"
  kill -KILL -- "-$pid" 2>/dev/null || kill -KILL "$pid"
  while kill -0 "$pid" 2>/dev/null; do sleep 0.05; done
  echo "galera: killed node $1 (pid $pid)"
}

restart_node() {
  check_node "$1"
  local n=$1 position started=$SECONDS
  [[ -z $(node_pid "$n") ]] || die "node $n is running; kill it first"
  rm -f "$(socket "$n")" "$(node_dir "$n")/mariadbd.pid"
  # After a crash grastate.dat holds seqno -1: recover the last committed position from
  # InnoDB, then start from it so the node receives only the missing write sets (IST).
  "$MARIADBD" --defaults-file="$(node_dir "$n")/my.cnf" --wsrep-recover \
    --log-error="$(node_dir "$n")/recover.log" >/dev/null 2>&1 ||
    die "wsrep-recover of node $n failed; see $(node_dir "$n")/recover.log"
  position=$(sed -n 's/.*WSREP: Recovered position: *//p' "$(node_dir "$n")/recover.log" | tail -n 1)
  [[ -n $position ]] || die "no recovered position for node $n in $(node_dir "$n")/recover.log"
  rm -f "$(node_dir "$n")/recover.log"
  launch "$n" --wsrep-start-position="$position"
  wait_synced "$n" 90
  echo "galera: node $n rejoined at $position in $((SECONDS - started)) s"
}

urls() {
  local out=""
  for n in "${NODES[@]}"; do
    out+="${out:+,}mysql://root@127.0.0.1:$(sql_port "$n")/test"
  done
  echo "$out"
}

status() {
  for n in "${NODES[@]}"; do
    echo "node $n: pid $(node_pid "$n") state $(wsrep_state "$n" || true) size $(cluster_size "$n" || true)"
  done
}

case ${1:-} in
  start) start ;;
  stop) stop ;;
  kill) kill_node "${2:-}" ;;
  restart) restart_node "${2:-}" ;;
  urls) urls ;;
  status) status ;;
  *) die "usage: $0 start|stop|kill N|restart N|urls|status" ;;
esac

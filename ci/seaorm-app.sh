#!/usr/bin/env bash
# The acceptance app (ci/seaorm-app, laid out like SeaORM's examples) driven by SeaORM's
# own tooling, the real `sea-orm-cli` 2.0.4, in a temporary copy:
#
#  1. `migrate generate` (and the migration crate's own `cargo run -- generate`) rebuilds
#     `migrations()` from the `mod m..._...;` lines: the inbox migrations, each a module
#     file named after its stable name, must still be listed.
#     The control: the README's former form (`Box::new(sea_orm_inbox_migration::CreateInbox)`
#     written into lib.rs) must lose them, or the check proves nothing.
#  2. `migrate up` and `migrate status` on a fresh PostgreSQL database (and MariaDB when
#     INBOX_TEST_MYSQL_URL is set): every library migration applied, and the new ones.
#  3. Two processes of the app's consumer (the library's RabbitMQ consumer loop) read one
#     quorum queue into that database: 224 messages, 20 published twice, one with the
#     non-UUID id `order-42` (twice), one with the nil UUID, one whose payload the app
#     marks `Permanent`. Effects == distinct valid messages; the nil-id and the permanent
#     messages are dead-lettered on their first delivery and never redelivered. The
#     per-delivery checks read the loop's DEBUG event `the loop settled the delivery`
#     (its `outcome` and `settlement`, in the `inbox.delivery{broker_id=..}` span), the
#     counts the app prints from the loop's `ConsumerSummary` at exit.
#     Then once more on a fresh PostgreSQL database with the replicas behind a TCP proxy
#     (`broker proxy`, a free loopback port; the machine's RabbitMQ is never touched) that
#     cuts their connections mid-run and refuses new ones for 3 s, while the rest is
#     published: the same checks, each replica's loop reconnected, and deliveries beyond
#     published + nacks only as many as the cut caught.
#  4. `generate entity --ignore-tables seaql_migrations,inbox,outbox` writes no inbox or
#     outbox entity; the control: without the flag it writes both.
#
# Needs INBOX_TEST_POSTGRES_URL (an existing database the user may create databases from)
# and INBOX_TEST_AMQP_URL (or AMQP_URL). Any failed step fails the script.
#
# `seaorm-app.sh prebuild` only compiles the app's crates, with the same cargo commands
# the steps run, into CARGO_TARGET_DIR: .ci/run does that in the background while the
# cluster suites wait on their nodes, so the run itself compiles nothing but the app.
set -euo pipefail
mode=${1:-run}
[[ $mode == run || $mode == prebuild ]] || { echo "usage: $0 [prebuild]" >&2; exit 2; }
repo=$(cd "$(dirname "$0")/.." && pwd)
# The library's target directory: the app's dependencies compile once with the library's.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
pg_admin=${INBOX_TEST_POSTGRES_URL:?set INBOX_TEST_POSTGRES_URL, e.g. postgres://postgres@127.0.0.1:5432/test}
mysql_admin=${INBOX_TEST_MYSQL_URL:-}
export AMQP_URL=${INBOX_TEST_AMQP_URL:-${AMQP_URL:?set INBOX_TEST_AMQP_URL, e.g. amqp://guest:guest@127.0.0.1:5672/%2f}}
script_start=$SECONDS

say() { echo "seaorm-app: $*"; }
fail() { echo "seaorm-app: FAILED: $*" >&2; exit 1; }
# name, command...: runs a step and prints how long it took. (Inside a step, `set -e` is
# off, as in any command tested by `||`: the steps end each command with `|| return 1`.)
step() {
  local name=$1 start=$SECONDS; shift
  say "$name"
  "$@" || fail "$name"
  say "  $name: $((SECONDS - start)) s"
}

if [[ $mode == run ]]; then
  step "install sea-orm-cli if missing (ci/install-sea-orm-cli.sh)" bash "$repo/ci/install-sea-orm-cli.sh"
fi

work=$(mktemp -d)
databases=()
queues=()
consumers=()
cleanup() {
  for pid in "${consumers[@]}"; do kill -TERM "$pid" 2>/dev/null || true; done
  for queue in "${queues[@]}"; do "$broker" delete "$queue" || true; done
  for db in "${databases[@]}"; do
    case $db in
      postgres:*) psql "$pg_admin" -qc "DROP DATABASE IF EXISTS ${db#postgres:} WITH (FORCE)" || true ;;
      mysql:*) mysql_cmd -e "DROP DATABASE IF EXISTS ${db#mysql:}" || true ;;
    esac
  done
  rm -rf "$work"
}
trap cleanup EXIT

# The MariaDB admin URL's parts, for the mariadb client (mysql://user[:pass]@host[:port]/db).
mysql_cmd() {
  local rest=${mysql_admin#*://} auth hostport user pass host port
  auth=${rest%%@*}; hostport=${rest#*@}; hostport=${hostport%%/*}
  user=${auth%%:*}; pass=""; [[ $auth == *:* ]] && pass=${auth#*:}
  host=${hostport%%:*}; port=3306; [[ $hostport == *:* ]] && port=${hostport#*:}
  mariadb -h "$host" -P "$port" -u "$user" ${pass:+-p"$pass"} "$@"
}

app=$work/app
cp -r "$repo/ci/seaorm-app" "$app"
rm -rf "$app/target"
# The copy's path dependencies point at this checkout.
sed -i "s#path = \"../../#path = \"$repo/#" "$app/Cargo.toml"
cd "$app"
consumer_bin=$CARGO_TARGET_DIR/debug/seaorm-app
broker=$CARGO_TARGET_DIR/debug/broker

# The migration crate alone (what `cargo run -- generate` and sea-orm-cli's `migrate up`
# build), then the binaries (build_app below): each selection resolves features its own way.
prebuild_app() { (cd migration && cargo build --quiet) && cargo build --quiet --bins; }
if [[ $mode == prebuild ]]; then
  step "prebuild: compile the migration crate and the binaries" prebuild_app
  say "prebuilt in $((SECONDS - script_start)) s"
  exit 0
fi

# The stable names of the library's migrations, as their `MigrationName` impls spell them.
mapfile -t inbox_migrations < <(grep -ho '"m[0-9]\{8\}_[0-9]\{6\}_[a-z0-9_]*"' \
  "$repo"/inbox-migration/src/m*.rs | tr -d '"' | sort -u)
(( ${#inbox_migrations[@]} > 0 )) || fail "no migration names found in inbox-migration/src"
say "library migrations: ${inbox_migrations[*]}"

# --- 1. migrate generate --------------------------------------------------------------
lists_inbox_migrations() { # lib.rs: each library migration has its mod line and its Box::new
  local lib=$1 name missing=0
  for name in "${inbox_migrations[@]}"; do
    if ! grep -q "^mod $name;" "$lib" || ! grep -q "Box::new($name::Migration)" "$lib"; then
      echo "seaorm-app:   $lib lacks $name" >&2
      missing=1
    fi
  done
  return $missing
}

generate_loses_the_former_form() {
  local old=$work/former
  mkdir -p "$old/src" && cat >"$old/src/lib.rs" <<'EOF' || return 1
pub use sea_orm_migration::prelude::*;

mod m20240101_000001_create_ledger;

pub struct Migrator;

#[async_trait::async_trait]
impl MigratorTrait for Migrator {
    fn migrations() -> Vec<Box<dyn MigrationTrait>> {
        vec![
            Box::new(m20240101_000001_create_ledger::Migration),
            Box::new(sea_orm_inbox_migration::CreateInbox),
            Box::new(sea_orm_inbox_migration::AddInboxLeases),
        ]
    }
}
EOF
  sea-orm-cli migrate generate -d "$old" add_something >/dev/null || return 1
  if grep -q sea_orm_inbox_migration "$old/src/lib.rs"; then
    echo "seaorm-app:   the former form survived generate: the check below would prove nothing" >&2
    return 1
  fi
  say "  control: with Box::new(sea_orm_inbox_migration::..) in lib.rs, generate removed them:"
  sed -n '/vec!\[/,/\]/p' "$old/src/lib.rs"
}
step "control: migrate generate drops the former README form" generate_loses_the_former_form

# suffix, table: gives the module `generate` just wrote (its body is `todo!()`) a real
# migration, creating `table`, as its author would; records its name in new_migrations.
fill_in_generated() {
  local suffix=$1 table=$2 file name
  file=$(ls migration/src/m*_"$suffix".rs) || return 1
  name=$(basename "$file" .rs)
  cat >"$file" <<EOF || return 1
use sea_orm_migration::{prelude::*, schema::*};

pub struct Migration;

impl MigrationName for Migration {
    fn name(&self) -> &str {
        "$name"
    }
}

#[async_trait::async_trait]
impl MigrationTrait for Migration {
    async fn up(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager
            .create_table(Table::create().table("$table").col(pk_auto("id")).to_owned())
            .await
    }

    async fn down(&self, manager: &SchemaManager) -> Result<(), DbErr> {
        manager.drop_table(Table::drop().table("$table").to_owned()).await
    }
}
EOF
  new_migrations+=("$name")
}

new_migrations=()
generate_keeps_the_module_files() {
  lists_inbox_migrations migration/src/lib.rs || return 1
  sea-orm-cli migrate generate -d migration add_something || return 1
  lists_inbox_migrations migration/src/lib.rs || return 1
  fill_in_generated add_something something || return 1
  # The migration crate's own command line runs the same generator, from its folder.
  (cd migration && cargo run --quiet -- generate add_another) || return 1
  lists_inbox_migrations migration/src/lib.rs || return 1
  fill_in_generated add_another another || return 1
  say "  migrations() after both:"
  sed -n '/vec!\[/,/\]/p' migration/src/lib.rs
}
step "sea-orm-cli migrate generate, then cargo run -- generate, keep the inbox migrations" generate_keeps_the_module_files

# --- 2./3. migrate up, status, the consumer, on each server -----------------------------
migrate_and_consume() { # label, admin URL, database kind[, cut]
  local label=$1 admin=$2 kind=$3 cut=${4:-}
  local name="inbox_app_$(date +%s)_$$_$kind${cut:+_cut}"
  case $kind in
    postgres) psql "$admin" -qc "CREATE DATABASE $name" || return 1 ;;
    mysql) mysql_cmd -e "CREATE DATABASE $name" || return 1 ;;
  esac
  databases+=("$kind:$name")
  local url="${admin%/*}/$name"
  db_url=$url

  sea-orm-cli migrate up -d migration -u "$url" || return 1
  local status
  status=$(sea-orm-cli migrate status -d migration -u "$url" 2>&1) || { echo "$status"; return 1; }
  echo "$status" | grep "Migration '"
  for migration in "${inbox_migrations[@]}" "${new_migrations[@]}" m20240101_000001_create_ledger; do
    grep -q "Migration '$migration'... Applied" <<<"$status" \
      || { echo "seaorm-app:   $label: $migration is not applied" >&2; return 1; }
  done
  consume_from_rabbitmq "$label" "$kind" "$url" "$name" "$cut" || return 1
}

ledger_counts() { # kind, url, database: "<rows> <distinct message ids>"
  local query="SELECT count(*), count(DISTINCT message_id) FROM ledger"
  case $1 in
    postgres) psql "$2" -tA -F' ' -c "$query" ;;
    mysql) mysql_cmd -N -D "$3" -e "$query" | tr '\t' ' ' ;;
  esac
}

nil_id=00000000-0000-0000-0000-000000000000
# label, kind, database URL, database name: two consumer processes on one fresh queue.
# With `cut`, the replicas reach RabbitMQ through `broker proxy`, which cuts them mid-run.
consume_from_rabbitmq() {
  local label=$1 kind=$2 url=$3 name=$4 cut=$5
  local queue="seaorm-app.$(date +%s).$$.$kind${cut:+.cut}" logs=() pids=() i id
  local replica_url=$AMQP_URL proxy=""
  queues+=("$queue")
  if [[ -n $cut ]]; then
    local upstream=${AMQP_URL#*://} proxy_port=""
    upstream=${upstream#*@}; upstream=${upstream%%/*}
    "$broker" proxy "$upstream" >"$work/proxy-$kind.port" &
    proxy=$!
    consumers+=("$proxy")
    for i in $(seq 1 50); do
      proxy_port=$(head -n 1 "$work/proxy-$kind.port")
      [[ -n $proxy_port ]] && break
      sleep 0.1
    done
    [[ -n $proxy_port ]] || { echo "seaorm-app:   $label: the proxy did not start" >&2; return 1; }
    replica_url=${AMQP_URL/$upstream/127.0.0.1:$proxy_port}
    say "  $label: the replicas reach RabbitMQ ($upstream) through a proxy on port $proxy_port"
  fi
  for i in 1 2; do
    logs+=("$work/consumer-$kind${cut:+-cut}-$i.log")
    DATABASE_URL=$url AMQP_QUEUE=$queue AMQP_URL=$replica_url "$consumer_bin" >"${logs[-1]}" 2>&1 &
    pids+=($!)
    consumers+=($!)
  done
  # Both replicas consume before the first message: the queue is theirs to share. (The
  # replicas declare it; until then `consumers` fails.)
  local consuming=0
  for i in $(seq 1 120); do
    consuming=$("$broker" consumers "$queue" 2>/dev/null || echo 0)
    (( consuming == 2 )) && break
    for pid in "${pids[@]}"; do
      kill -0 "$pid" 2>/dev/null || { cat "${logs[@]}" >&2; echo "seaorm-app:   $label: a consumer exited at start" >&2; return 1; }
    done
    sleep 0.5
  done
  (( consuming == 2 )) || { echo "seaorm-app:   $label: $consuming of the 2 consumers started in 60 s" >&2; return 1; }

  # 200 orders (with `cut` 1,200, so that the cut finds the replicas busy), every tenth
  # published twice (a producer's retry) right after itself; `order-42`, a broker id that
  # is no UUID, first and last; the nil UUID once; once `unparsable-1`, whose payload is
  # no amount: the app's handler fails it `Permanent`.
  # Published in two halves; with `cut`, the second while the proxy refuses the replicas,
  # so that the messages the checks follow one by one (after order-42's first copy) are
  # consumed after the outage, when no cut can take their settlement.
  local orders=200
  [[ -n $cut ]] && orders=1200
  local published=(order-42) valid=$((orders + 1)) poison=unparsable-1 first_half
  for i in $(seq 1 $orders); do
    id=$(cat /proc/sys/kernel/random/uuid)
    published+=("$id")
    (( i % 10 == 0 )) && published+=("$id")
    (( i == orders / 2 )) && first_half=${#published[@]} && published+=("$nil_id")
    (( i == orders * 3 / 4 )) && published+=("$poison:ten")
  done
  published+=(order-42)
  if [[ -z $cut ]]; then
    "$broker" publish "$queue" "${published[@]:0:first_half}" || return 1
  else
    # The first half in the background, so that the cut comes while it still flows.
    "$broker" publish "$queue" "${published[@]:0:first_half}" &
    local publisher=$! settled_before=0
    for i in $(seq 1 300); do
      settled_before=$(cat "${logs[@]}" | grep -c 'the loop settled the delivery' || true)
      (( settled_before >= 40 )) && break
      sleep 0.1
    done
    (( settled_before >= 40 && settled_before < first_half )) \
      || { echo "seaorm-app:   $label: the cut should come mid-run: $settled_before of $first_half settled" >&2; return 1; }
    kill -USR1 "$proxy"
    say "  $label: cut every replica connection after $settled_before settled deliveries; refusing new ones for 3 s"
    wait "$publisher" || return 1
  fi
  "$broker" publish "$queue" "${published[@]:first_half}" || return 1
  if [[ -n $cut ]]; then
    sleep 3
    kill -USR2 "$proxy"
  fi
  say "  $label: published ${#published[@]} messages ($valid distinct valid ids, one nil, one permanent failure) to $queue"

  # Drained: every message settled once, nothing ready, both dead letters arrived. Bounded.
  local settled=0 ready=-1 dead=-1 deadline=$((SECONDS + 120))
  while (( SECONDS < deadline )); do
    settled=$(cat "${logs[@]}" | grep -c 'the loop settled the delivery' || true)
    read -r ready dead < <("$broker" count "$queue") || return 1
    (( settled >= ${#published[@]} && ready == 0 && dead >= 2 )) && break
    for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null || break 2; done
    sleep 0.5
  done
  (( settled >= ${#published[@]} && ready == 0 && dead >= 2 )) || {
    tail -n 20 "${logs[@]}" >&2
    echo "seaorm-app:   $label: not drained in 120 s: $settled settled, $ready ready, $dead dead letters" >&2
    return 1
  }
  sleep 2 # a redelivery loop would show more deliveries by now
  for pid in "${pids[@]}"; do kill -TERM "$pid"; done
  local status=0
  for pid in "${pids[@]}"; do wait "$pid" || status=1; done
  if [[ -n $proxy ]]; then kill -TERM "$proxy"; wait "$proxy" || true; fi
  consumers=()
  grep -h 'stopped:' "${logs[@]}"
  (( status == 0 )) || { cat "${logs[@]}" >&2; echo "seaorm-app:   $label: a consumer failed" >&2; return 1; }

  local failed=0 rows distinct dead_letters
  complain() { echo "seaorm-app:   $label: $*" >&2; failed=1; }
  read -r rows distinct < <(ledger_counts "$kind" "$url" "$name")
  say "  $label: ledger rows $rows ($distinct distinct message ids), expected $valid"
  (( rows == valid && distinct == valid )) || complain "effects != distinct valid messages"
  read -r ready dead < <("$broker" count "$queue")
  (( ready == 0 )) || complain "$ready messages left in $queue"
  dead_letters=$("$broker" dead-letters "$queue" | sort | tr '\n' ' ')
  say "  $label: dead-letter queue: $dead_letters"
  [[ $dead_letters == "$nil_id $poison " ]] \
    || complain "the dead-letter queue should hold the nil-id and the $poison messages once each"
  # Per delivery, from the loop's events: the settled ones of one broker id (the span's
  # broker_id), as "<outcome> <settlement>" lines.
  settled_of() { cat "${logs[@]}" | grep 'the loop settled the delivery' | grep -F "broker_id=$1 " \
    | sed -E 's/.*outcome="?([a-z]+)"? settlement=([A-Za-z]+).*/\1 \2/'; }
  local order_42
  order_42=$(settled_of order-42 | sort | uniq -c | tr -s ' ' | tr '\n' ',')
  [[ $order_42 == " 1 duplicate Ack, 1 processed Ack," ]] \
    || complain "order-42, published twice, should be processed once and a duplicate once: $order_42"
  local poison_deliveries
  poison_deliveries=$(settled_of "$poison" | tr '\n' ',')
  [[ $poison_deliveries == "failed DeadLetter," ]] \
    || complain "$poison, failed Permanent, should be dead-lettered on its first delivery: $poison_deliveries"
  local nil_deliveries deliveries=0 processed=0 dead_lettered=0 nacked=0 settle_failures=0 n
  # A delivery without a usable id has no inbox.delivery span: its warning names the nil
  # UUID, and the settled event after it says what the broker was told.
  nil_deliveries=$(cat "${logs[@]}" | grep -c "the message id is the nil UUID" || true)
  (( nil_deliveries == 1 )) || complain "the nil-id message was delivered $nil_deliveries times"
  n=$(cat "${logs[@]}" | grep 'the loop settled the delivery' | grep -Ec 'outcome="?unmappable"? settlement=DeadLetter' || true)
  (( n == 1 )) || complain "$n deliveries without a usable id dead-lettered, expected the nil-id one"
  for log in "${logs[@]}"; do
    n=$(grep -o 'deliveries=[0-9]*' "$log" | cut -d= -f2)
    (( n > 0 )) || complain "$log: this consumer got no delivery"
    deliveries=$((deliveries + n))
    processed=$((processed + $(grep -o 'processed=[0-9]*' "$log" | cut -d= -f2)))
    dead_lettered=$((dead_lettered + $(grep -o 'dead_lettered=[0-9]*' "$log" | cut -d= -f2)))
    nacked=$((nacked + $(grep -o 'nacked=[0-9]*' "$log" | cut -d= -f2)))
    settle_failures=$((settle_failures + $(grep -o 'settle_failures=[0-9]*' "$log" | cut -d= -f2)))
  done
  (( processed == valid )) || complain "$processed processed, expected $valid"
  (( dead_lettered == 2 )) || complain "$dead_lettered dead-lettered, expected 2 (the nil id, $poison)"
  if [[ -z $cut ]]; then
    # Every redelivery answers a nack: none was redelivered otherwise.
    (( deliveries == ${#published[@]} + nacked )) \
      || complain "$deliveries deliveries for ${#published[@]} messages and $nacked nacks"
  else
    # Beyond those, only the deliveries the cut caught (at most each replica's prefetch
    # of 4, and those whose acks it took) came again; each replica's loop reconnected.
    local extra=$((deliveries - ${#published[@]} - nacked)) reconnects
    (( extra >= 0 && extra <= 8 + settle_failures )) \
      || complain "$deliveries deliveries for ${#published[@]} messages, $nacked nacks and $settle_failures settle failures"
    for log in "${logs[@]}"; do
      reconnects=$(grep -o 'reconnects=[0-9]*' "$log" | cut -d= -f2)
      (( reconnects >= 1 )) || complain "$log: this replica's loop did not reconnect"
    done
  fi
  (( failed == 0 )) || { cat "${logs[@]}" >&2; return 1; }
  "$broker" delete "$queue" || return 1
  unset 'queues[-1]'
}
build_app() { cargo build --quiet --bins; }
step "build the app's consumer and the CI's producer" build_app
step "PostgreSQL: migrate up, migrate status, two consumers on RabbitMQ" migrate_and_consume PostgreSQL "$pg_admin" postgres
pg_url=$db_url
step "PostgreSQL: the same, the consumers' RabbitMQ connections cut mid-run" migrate_and_consume "PostgreSQL, cut" "$pg_admin" postgres cut

# --- 4. generate entity ---------------------------------------------------------------
entities_skip_the_inbox() {
  local with=$work/entities-ignoring without=$work/entities-default
  sea-orm-cli generate entity -u "$pg_url" -o "$with" --ignore-tables seaql_migrations,inbox,outbox >/dev/null || return 1
  sea-orm-cli generate entity -u "$pg_url" -o "$without" >/dev/null || return 1
  say "  with --ignore-tables seaql_migrations,inbox,outbox: $(cd "$with" && ls | tr '\n' ' ')"
  say "  without it:                                         $(cd "$without" && ls | tr '\n' ' ')"
  [[ -f $with/ledger.rs ]] || { echo "seaorm-app:   no ledger entity: the run generated nothing" >&2; return 1; }
  local table
  for table in inbox outbox; do
    [[ ! -e $with/$table.rs ]] || { echo "seaorm-app:   an $table entity was written despite --ignore-tables" >&2; return 1; }
    grep -qw "$table" "$with/mod.rs" && { echo "seaorm-app:   mod.rs names an $table module" >&2; return 1; }
    [[ -f $without/$table.rs ]] || { echo "seaorm-app:   control: no $table entity without the flag, the check proves nothing" >&2; return 1; }
  done
  return 0
}
step "sea-orm-cli generate entity writes no inbox or outbox entity with --ignore-tables" entities_skip_the_inbox

if [[ -n $mysql_admin ]]; then
  step "MariaDB: migrate up, migrate status, two consumers on RabbitMQ" migrate_and_consume MariaDB "$mysql_admin" mysql
else
  say "MariaDB: skipped, INBOX_TEST_MYSQL_URL is not set"
fi

say "ok in $((SECONDS - script_start)) s"

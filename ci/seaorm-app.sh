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
#  3. The app's consumer processes messages through `Inbox::process` on that database.
#  4. `generate entity --ignore-tables seaql_migrations,inbox` writes no inbox entity; the
#     control: without the flag it does.
#
# Needs INBOX_TEST_POSTGRES_URL (an existing database the user may create databases from).
# Any failed step fails the script.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
# The library's target directory: the app's dependencies compile once with the library's.
export CARGO_TARGET_DIR="${CARGO_TARGET_DIR:-$repo/target}"
export CARGO_TERM_COLOR=never
pg_admin=${INBOX_TEST_POSTGRES_URL:?set INBOX_TEST_POSTGRES_URL, e.g. postgres://postgres@127.0.0.1:5432/test}
mysql_admin=${INBOX_TEST_MYSQL_URL:-}
cli_version=2.0.4
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

install_cli() {
  if sea-orm-cli --version 2>/dev/null | grep -qx "sea-orm-cli $cli_version"; then
    say "  sea-orm-cli $cli_version already installed"
    return 0
  fi
  # Its own target directory: sea-orm-cli's lock file shares little with ours.
  env -u CARGO_TARGET_DIR cargo install "sea-orm-cli@$cli_version" --locked --quiet
  sea-orm-cli --version | grep -qx "sea-orm-cli $cli_version"
}
step "install sea-orm-cli $cli_version if missing" install_cli

work=$(mktemp -d)
databases=()
cleanup() {
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
migrate_and_consume() { # label, admin URL, database kind
  local label=$1 admin=$2 kind=$3
  local name="inbox_app_$(date +%s)_$$_$kind"
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
  DATABASE_URL=$url cargo run --quiet -p seaorm-app || return 1
}
step "PostgreSQL: migrate up, migrate status, the consumer" migrate_and_consume PostgreSQL "$pg_admin" postgres
pg_url=$db_url

# --- 4. generate entity ---------------------------------------------------------------
entities_skip_the_inbox() {
  local with=$work/entities-ignoring without=$work/entities-default
  sea-orm-cli generate entity -u "$pg_url" -o "$with" --ignore-tables seaql_migrations,inbox >/dev/null || return 1
  sea-orm-cli generate entity -u "$pg_url" -o "$without" >/dev/null || return 1
  say "  with --ignore-tables seaql_migrations,inbox: $(cd "$with" && ls | tr '\n' ' ')"
  say "  without it:                                  $(cd "$without" && ls | tr '\n' ' ')"
  [[ -f $with/ledger.rs ]] || { echo "seaorm-app:   no ledger entity: the run generated nothing" >&2; return 1; }
  [[ ! -e $with/inbox.rs ]] || { echo "seaorm-app:   an inbox entity was written despite --ignore-tables" >&2; return 1; }
  grep -qw inbox "$with/mod.rs" && { echo "seaorm-app:   mod.rs names an inbox module" >&2; return 1; }
  [[ -f $without/inbox.rs ]] || { echo "seaorm-app:   control: no inbox entity without the flag, the check proves nothing" >&2; return 1; }
  return 0
}
step "sea-orm-cli generate entity writes no inbox entity with --ignore-tables" entities_skip_the_inbox

if [[ -n $mysql_admin ]]; then
  step "MariaDB: migrate up, migrate status, the consumer" migrate_and_consume MariaDB "$mysql_admin" mysql
else
  say "MariaDB: skipped, INBOX_TEST_MYSQL_URL is not set"
fi

say "ok in $((SECONDS - script_start)) s"

#!/usr/bin/env bash
# Installs the Debian packages the PostgreSQL cluster fixtures need when they are missing:
# HAProxy (the failover cluster's stable address) and PgBouncer (the pooler tests).
# PostgreSQL 15 itself is the system server's package.
set -euo pipefail

missing=()
command -v haproxy >/dev/null || missing+=(haproxy)
command -v pgbouncer >/dev/null || missing+=(pgbouncer)
[[ -x /usr/lib/postgresql/15/bin/pg_basebackup ]] || missing+=(postgresql-15)
if ((${#missing[@]})); then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi

#!/bin/sh
# HAProxy external check of tests/cluster/pg-failover.sh: succeeds only when the server at
# $3:$4 (HAProxy passes proxy address, proxy port, server address, server port) accepts
# connections and is not in recovery (a primary, never a standby). It calls the psql
# binary itself, not Debian's Perl wrapper, to stay well inside the check interval.
[ "$(/usr/lib/postgresql/15/bin/psql -h "$3" -p "$4" -U postgres -d postgres \
    -w -Atc 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ]

#!/bin/sh
# HAProxy external check of tests/cluster/pg-failover.sh: succeeds only when the server at
# $HAPROXY_SERVER_ADDR:$HAPROXY_SERVER_PORT accepts connections and is not in recovery
# (a primary, never a standby).
[ "$(psql -h "$HAPROXY_SERVER_ADDR" -p "$HAPROXY_SERVER_PORT" -U postgres -d postgres \
    -w -Atc 'SELECT pg_is_in_recovery()' 2>/dev/null)" = f ]

#!/usr/bin/env bash
# Installs what the cluster fixtures need from Debian's packages, when it is missing:
# galera-4 (the replication provider), rsync (the state transfer) and socat (its helper),
# plus the MariaDB server and client binaries the Galera nodes run.
set -euo pipefail

missing=()
[[ -e /usr/lib/galera/libgalera_smm.so ]] || missing+=(galera-4)
command -v rsync >/dev/null || missing+=(rsync)
command -v socat >/dev/null || missing+=(socat)
command -v mariadbd >/dev/null || [[ -x /usr/sbin/mariadbd ]] || missing+=(mariadb-server)
command -v mariadb >/dev/null || missing+=(mariadb-client)

if ((${#missing[@]} == 0)); then
  exit 0
fi
echo "cluster: installing ${missing[*]}"
export DEBIAN_FRONTEND=noninteractive
apt-get update
apt-get install -y --no-install-recommends "${missing[@]}"

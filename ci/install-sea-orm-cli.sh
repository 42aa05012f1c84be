#!/usr/bin/env bash
# Installs the real sea-orm-cli that ci/seaorm-app.sh drives, unless that version is
# already on PATH. One place for the version and the install command: .ci/run starts this
# in the background at low priority at the beginning of the run (a cold install compiles
# for about 4 minutes, which the test and cluster steps' waits on I/O can absorb), and
# seaorm-app.sh calls it again, which then returns at once.
set -euo pipefail
cli_version=2.0.4
if sea-orm-cli --version 2>/dev/null | grep -qx "sea-orm-cli $cli_version"; then
  echo "install-sea-orm-cli: sea-orm-cli $cli_version already installed"
  exit 0
fi
# Its own target directory: sea-orm-cli's lock file shares little with ours.
env -u CARGO_TARGET_DIR cargo install "sea-orm-cli@$cli_version" --locked --quiet
sea-orm-cli --version | grep -qx "sea-orm-cli $cli_version"
echo "install-sea-orm-cli: sea-orm-cli $cli_version installed"

#!/bin/sh
# Install litegraph-node as a systemd service, as root, on Debian 12 or
# Ubuntu 24.04 (Python 3.11 or newer).
#
#   sh deploy/install.sh [--dry-run] [WHEEL-OR-CHECKOUT]
#
# WHEEL-OR-CHECKOUT is what pip installs (default: the checkout this script is
# in). --dry-run prints each command instead of running it.
#
# It creates everything deploy/litegraph-node.service names
# (tests/unit/test_deploy.py checks this against the unit):
#   - the system user and group `litegraph` (User=, Group=);
#   - the venv /opt/litegraph-node, whose bin/litegraph-node is ExecStart=;
#   - the unit itself, /etc/systemd/system/litegraph-node.service.
# systemd makes the rest at each start: /var/lib/litegraph-node (0700,
# StateDirectory=; the daemon writes its keys, journal and auth.json there)
# and /run/litegraph-node (0711, RuntimeDirectory=, --guest-run-dir).
# Running it again upgrades the package in place and restarts the service.
set -eu

dry_run=0
if [ "${1:-}" = "--dry-run" ]; then
    dry_run=1
    shift
fi
here=$(cd "$(dirname "$0")" && pwd)
source=${1:-$(dirname "$here")}

run() {
    if [ "$dry_run" = 1 ]; then
        printf '+ %s\n' "$*"
    else
        "$@"
    fi
}

# bubblewrap is every guest's sandbox; python3-venv makes the venv; gcc and libc6-dev
# build litegraph-gate, every guest's first exec.
run apt-get update
run apt-get install -y --no-install-recommends bubblewrap python3-venv gcc libc6-dev
if [ "$dry_run" = 1 ] || ! getent group litegraph >/dev/null; then
    run groupadd --system litegraph
fi
if [ "$dry_run" = 1 ] || ! getent passwd litegraph >/dev/null; then
    run useradd --system --gid litegraph --no-create-home \
        --home-dir /var/lib/litegraph-node --shell /usr/sbin/nologin litegraph
fi
run python3 -m venv /opt/litegraph-node
run /opt/litegraph-node/bin/pip install --upgrade "$source"
if [ -f "$source/native/litegraph-gate.c" ]; then
    run sh "$source/scripts/build-gate" /opt/litegraph-node/bin/litegraph-gate
fi
run install -m 0644 "$here/litegraph-node.service" /etc/systemd/system/litegraph-node.service
run systemctl daemon-reload
run systemctl enable litegraph-node.service
run systemctl restart litegraph-node.service

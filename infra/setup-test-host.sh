#!/usr/bin/env bash
# Prepares a machine to run the whole test suite: the system parts the tests use for real
# (bcc for the eBPF agent tests, matching kernel headers, tracefs; stunnel4, the TLS endpoint in
# front of the test Kafka broker). Python packages come from `pip install -e '.[dev]'`.
# Idempotent; needs root (apt-get, /lib/modules, mounts).
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
if [ "$(id -u)" -ne 0 ]; then
    echo "setup-test-host: needs root (apt-get, kernel headers, tracefs); rerun with sudo" >&2
    exit 1
fi
bash "$here/ebpf-host-setup.sh"
if ! command -v stunnel4 >/dev/null && ! command -v stunnel >/dev/null; then
    apt-get update -qq
    apt-get install -y -qq --no-install-recommends stunnel4 >/dev/null
fi

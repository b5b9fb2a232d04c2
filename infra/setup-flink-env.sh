#!/usr/bin/env bash
# Makes the PyFlink job's own virtual environment: apache-flink pins numpy<2.2 (through
# apache-beam) while river needs numpy>=2.2.5, so the Flink job cannot share the main
# environment. Installs apache-flink, the two Kafka connector jars (taken out of the PyPI
# redistribution shigawire-apache-flink-libraries, where they are named flink-connector-kafka.jar
# and kafka-clients.jar without versions; installing that package would overwrite
# apache-flink's own libraries) and trainscope itself without its heavy dependencies.
#   TRAINSCOPE_FLINK_VENV  the environment (default: .venv-flink at the repository root)
#   TRAINSCOPE_FLINK_JARS  where the two jars go (default: <venv>/jars)
#   PYTHON                 the interpreter that makes the environment (default: python3)
# Idempotent: a second run checks what is there and returns in a few seconds.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
venv=${TRAINSCOPE_FLINK_VENV:-$repo/.venv-flink}
jars=${TRAINSCOPE_FLINK_JARS:-$venv/jars}
python=${PYTHON:-python3}
flink_version=2.3.0
libraries=shigawire-apache-flink-libraries==2.0.0.post1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
vpy="$venv/bin/python"
if ! "$vpy" -c "import importlib.metadata as m, sys; sys.exit(m.version('apache-flink') != '$flink_version')" 2>/dev/null; then
    "$vpy" -m pip install -q "apache-flink==$flink_version"
fi
# The job module imports only these from trainscope's dependencies (see
# trainscope/streams/flink/__init__.py); numpy stays at what apache-flink pinned.
"$vpy" -c "import msgspec, click, yaml" 2>/dev/null || "$vpy" -m pip install -q "msgspec>=0.19" "click>=8.1" "pyyaml>=6"
if ! "$vpy" -c "import trainscope, pathlib, sys; sys.exit(pathlib.Path(trainscope.__file__).resolve().parent != pathlib.Path('$repo/trainscope').resolve())" 2>/dev/null; then
    "$vpy" -m pip install -q --no-deps --no-build-isolation -e "$repo" 2>/dev/null \
        || "$vpy" -m pip install -q --no-deps -e "$repo"
fi
if ! compgen -G "$jars/flink-connector-kafka*.jar" >/dev/null || ! compgen -G "$jars/kafka-clients*.jar" >/dev/null; then
    mkdir -p "$jars"
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    "$vpy" -m pip download -q --no-deps --dest "$tmp" "$libraries"
    "$vpy" - "$tmp" "$jars" <<'PY'
import pathlib, sys, zipfile
tmp, jars = map(pathlib.Path, sys.argv[1:])
wheel = next(tmp.glob("*.whl"))
with zipfile.ZipFile(wheel) as zf:
    wanted = [n for n in zf.namelist() if n.startswith("pyflink/lib/")
              and pathlib.PurePosixPath(n).name.startswith(("flink-connector-kafka", "kafka-clients"))
              and n.endswith(".jar")]
    if len(wanted) != 2:
        sys.exit(f"Error: expected 2 Kafka jars in {wheel.name}, found {wanted}")
    for name in wanted:
        (jars / pathlib.PurePosixPath(name).name).write_bytes(zf.read(name))
PY
fi
echo "setup-flink-env: $venv ready (python: $vpy, jars: $jars)"

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
libraries=shigawire-apache-flink-libraries==2.0.0.post1
export PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_PROGRESS_BAR=off

if [ ! -x "$venv/bin/python" ]; then
    "$python" -m venv "$venv"
fi
vpy="$venv/bin/python"
# The `flink` extra of pyproject.toml, read from there so the list lives in one place.
mapfile -t wanted < <("$vpy" - "$repo/pyproject.toml" <<'PY'
import sys, tomllib
with open(sys.argv[1], "rb") as f:
    print("\n".join(tomllib.load(f)["project"]["optional-dependencies"]["flink"]))
PY
)
if ! "$vpy" - "${wanted[@]}" <<'PY' 2>/dev/null
import sys
from importlib.metadata import PackageNotFoundError, version
from packaging.requirements import Requirement
for spec in sys.argv[1:]:
    req = Requirement(spec)
    try:
        if not req.specifier.contains(version(req.name), prereleases=True):
            sys.exit(1)
    except PackageNotFoundError:
        sys.exit(1)
PY
then
    "$vpy" -m pip install -q "${wanted[@]}"
fi
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

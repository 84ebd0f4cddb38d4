#!/usr/bin/env bash
# The whole test suite, from a fresh machine: installs what is missing, then runs pytest.
#   bash tests/run.sh            (extra arguments go to pytest, e.g. -k browser; -n 0 runs it in one process)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
# torch first: users bring their own (>= 2.4); without one, take the CPU build if it is on disk
"$PY" -c "import torch" 2>/dev/null || "$PY" -m pip install -q "torch>=2.4"
# the test dependencies never replace your torch: a constraint holds it at the version you have. torchvision (the
# model zoo, tests/zoo) is the release built for it (torch 2.N pairs with torchvision 0.N+15); without one the
# torchvision and timm zoos are skipped, naming why
keep_torch=$(mktemp)
trap 'rm -f "$keep_torch"' EXIT
"$PY" -c 'import torch; print("torch==" + torch.__version__.split("+")[0])' >"$keep_torch"
minor=$("$PY" -c 'import torch; print(torch.__version__.split(".")[1])')
"$PY" -c "import torchvision" 2>/dev/null || "$PY" -m pip install -q -c "$keep_torch" "torchvision==0.$((minor + 15)).*" \
    || echo "tests/run.sh: no torchvision for this torch; the torchvision and timm zoos are skipped" >&2
"$PY" -m pip install -q -c "$keep_torch" -r requirements-dev.txt
if ! command -v chromium >/dev/null || ! command -v chromedriver >/dev/null; then
    if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
        apt-get update -qq && apt-get install -y -qq chromium chromium-driver >/dev/null
    else
        echo "browser tests need Debian's chromium and chromium-driver: sudo apt-get install chromium chromium-driver" >&2
        exit 2
    fi
fi
# two workers, a test file each at a time (a file's shared runs and browser stay in one worker)
exec "$PY" -m pytest -q -n 2 --dist loadfile "$@"

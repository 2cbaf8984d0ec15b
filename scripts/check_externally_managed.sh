#!/usr/bin/env bash
# Checks the README's two commands where the system Python is externally managed (PEP 668: a
# Debian/Ubuntu system Python refuses `pip install` outside a virtual environment). It builds a
# stand-in for such a Python, the current Python's executable in a prefix of its own (not a venv:
# pip ignores the marker inside one) whose stdlib holds an EXTERNALLY-MANAGED file and whose
# site-packages holds only pip, puts it first on the PATH with no venv active, checks that it
# refuses an install, then runs the two commands in a clean clone of HEAD:
#   bash scripts/setup.sh && scripts/py -m varlen.run
#   bash scripts/setup.sh && scripts/py -m pytest -q -n logical --dist loadfile [ARGS]   (ARGS: this script's arguments)
# Usage, from the project root: bash scripts/check_externally_managed.sh [pytest args] ; KEEP=1 keeps the folder.
set -euo pipefail
root=$(git rev-parse --show-toplevel)
work=$(mktemp -d /tmp/pep668.XXXXXX)
trap '[ -n "${KEEP:-}" ] || rm -rf "$work"' EXIT
read -r base ver exe site < <(python3 -c 'import os, sys, sysconfig, pip
print(sys.base_prefix, "%d.%d" % sys.version_info[:2], os.path.realpath(getattr(sys, "_base_executable", sys.executable)),
      os.path.dirname(os.path.dirname(pip.__file__)))')
py=$work/python
mkdir -p "$py/bin" "$py/lib/python$ver/site-packages"
cp "$exe" "$py/bin/python3"
for f in "$base/lib/python$ver"/*; do [ "${f##*/}" = site-packages ] || ln -s "$f" "$py/lib/python$ver/"; done
for f in "$base"/lib/libpython*; do [ -e "$f" ] && ln -s "$f" "$py/lib/"; done
ln -s "$site/pip" "$py/lib/python$ver/site-packages/pip"
printf '[externally-managed]\nError=stand-in for a distribution Python (scripts/check_externally_managed.sh)\n' \
  > "$py/lib/python$ver/EXTERNALLY-MANAGED"
export PATH="$py/bin:$PATH" PYTHONNOUSERSITE=1
unset VIRTUAL_ENV PYTHONPATH PYTHON CONDA_PREFIX
[ "$(python3 -c 'import sys; print(sys.prefix)')" = "$py" ] || { echo "FAIL: the stand-in Python's prefix is not $py"; exit 1; }
if python3 -m pip install -q --dry-run --no-deps --no-index mypy-extensions >"$work/pip.log" 2>&1 \
   || ! grep -q externally-managed "$work/pip.log"; then
  echo "FAIL: the stand-in Python did not refuse an install as externally managed:"; cat "$work/pip.log"; exit 1
fi
echo "stand-in externally managed Python: $py/bin/python3 (refuses pip install: ok)"
git clone -q "$root" "$work/repo"
cd "$work/repo"
SECONDS=0
bash scripts/setup.sh && scripts/py -m varlen.run
[ -x .venv/bin/python ] || { echo "FAIL: setup.sh did not create .venv"; exit 1; }
echo "run command: ok (${SECONDS}s)"
bash scripts/setup.sh && scripts/py -m pytest -q -n logical --dist loadfile "$@"
echo "externally managed Python: both README commands PASSED in ${SECONDS}s"

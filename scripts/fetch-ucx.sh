#!/usr/bin/env bash
# Unpacks UCX 1.22 (built with CUDA: the libucx-cu12 wheel from PyPI) into DEST, without
# root: DEST/libucx/lib/libucp.so.0 is what HANDOFF_UCX_LIB=DEST/libucx/lib loads. Only
# the shared objects UCX loads (one name each) are kept, not the static archives or
# perftest's CUDA plugin. The wheel is downloaded once into WHEELS (default DEST/wheels).
# It runs on machines without a GPU too: UCX skips its CUDA transports there.
#
#   scripts/fetch-ucx.sh DEST [WHEELS]
set -euo pipefail
dest=${1:?usage: fetch-ucx.sh DEST [WHEELS]}
wheels=${2:-$dest/wheels}
version="1.22.0"
mkdir -p "$dest" "$wheels"
if ! ls "$wheels"/libucx_cu12-"$version"-*.whl >/dev/null 2>&1; then
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
        --implementation cp --platform manylinux_2_28_x86_64 \
        -d "$wheels" "libucx-cu12==$version"
fi
python3 - "$wheels"/libucx_cu12-"$version"-*.whl "$dest" <<'PY'
import re, sys, zipfile
wheel, dest = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(wheel) as z:
    for name in z.namelist():
        keep = re.search(r"libucx/lib/(ucx/)?lib[a-z_]+\.so\.0$", name) or \
            name.startswith("libucx_cu12.libs/")
        if keep and "perftest" not in name:
            z.extract(name, dest)
PY
test -e "$dest/libucx/lib/libucp.so.0"

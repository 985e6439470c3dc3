#!/usr/bin/env bash
# Stage vLLM 0.25.0 (+ its missing dependencies and PyJWT) onto the offline GPU host, in two
# transfers of < 64 MiB each. See bench/gpu/stage.md for the whole procedure and timings.
#
#   here:  bash bench/gpu/stage.sh bundle          # -> .gpu-stage/c1 (60 MiB), .gpu-stage/c2 (~57 MB)
#   host:  bash bench/gpu/stage.sh recv c1         # copy a carried part to /tmp/stage
#   host:  bash bench/gpu/stage.sh recv c2
#   host:  bash bench/gpu/stage.sh install         # /tmp/site (vllm), /tmp/site2 (wheels)
#   host:  eval "$(bash bench/gpu/stage.sh env)"   # PYTHONPATH and vLLM variables
#   here:  bash bench/gpu/stage.sh src             # HEAD's src/ + bench/ -> .gpu-stage/src (carry it; the
#                                                  # env line then puts .gpu-stage/src/src first on PYTHONPATH)
# Optional, for the RDMA transport over UCX cma (same-host nodes; no NIC on the lent host):
#   here:  bash bench/gpu/stage.sh nixl            # -> .gpu-stage/c3 (nixl-cu12 for cp312, 30 MB)
#   host:  bash bench/gpu/stage.sh recv c3 && bash bench/gpu/stage.sh install-nixl   # -> /tmp/site3
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
stage=${STAGE_DIR:-/tmp/stage}

case "${1:-}" in
  bundle)
    out="$here/.gpu-stage"
    mb=${MAKE_BUNDLE:-$here/../shared/gpu/make_bundle.sh}
    [ -d "$out/bundle" ] || bash "$mb" "$out/bundle"
    rm -rf "$out/c1" "$out/c2"
    mkdir -p "$out/c1" "$out/c2/wheels"
    # Re-split the vLLM tree (tar.gz) into one 60 MiB part and a rest that fits with the wheels.
    cat "$out"/bundle/vllm.part.* | split -b 60m - "$out/c1/vllm.part."
    mv "$out/c1/vllm.part.ab" "$out/c2/"
    cp "$out"/bundle/wheels/*.whl "$out/c2/wheels/"
    # memkv's own runtime dependency missing from the host image (license.py imports jwt).
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$out/c2/wheels" PyJWT==2.15.1
    du -b "$out"/c1 "$out"/c2
    ;;
  src)
    # The committed src/ and bench/ (git archive HEAD), for `carry`: a run then measures exactly
    # a commit, whatever is being edited in the working tree meanwhile.
    out="$here/.gpu-stage/src"
    rm -rf "$out" && mkdir -p "$out"
    git -C "$here" archive HEAD src bench | tar -x -C "$out"
    git -C "$here" rev-parse --short HEAD > "$out/COMMIT"
    echo "$out: $(cat "$out/COMMIT")"
    ;;
  nixl)
    # nixl-cu12's cp312 wheel is 69 MB; 38 MB of it is nixl_ep (expert-parallel kernels MemKV
    # never imports). Ship the rest as a plain tree: a wheel is a zip of site-packages content.
    out="$here/.gpu-stage/c3"
    rm -rf "$out" && mkdir -p "$out"
    tmp=$(mktemp -d)
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 -d "$tmp" nixl-cu12==1.5.1
    python3 - "$tmp"/nixl_cu12-*.whl "$out/nixl.tar.gz" <<'PY'
import io, sys, tarfile, zipfile
src, dst = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(src) as z, tarfile.open(dst, "w:gz") as t:
    for info in z.infolist():
        if info.filename.startswith("nixl_ep") or info.is_dir():
            continue
        data = z.read(info)
        ti = tarfile.TarInfo(info.filename)
        ti.size = len(data)
        ti.mode = 0o755 if info.filename.endswith((".so",)) or ".so." in info.filename else 0o644
        t.addfile(ti, io.BytesIO(data))
PY
    rm -rf "$tmp"
    du -b "$out"
    ;;
  install-nixl)
    mkdir -p /tmp/site3
    tar -xzf "$stage/nixl.tar.gz" -C /tmp/site3
    PYTHONPATH=/tmp/site3 python3 -c "import nixl_cu12._api as a; print('nixl ok', a.__file__)"
    ;;
  recv)
    part=${2:?recv c1|c2}
    mkdir -p "$stage"
    cp -r "$here/.gpu-stage/$part/." "$stage/"
    ls -la "$stage"
    ;;
  install)
    mkdir -p /tmp/site /tmp/site2
    cat "$stage"/vllm.part.* | tar -xzf - -C /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site2 "$stage"/wheels/*.whl
    PYTHONPATH=/tmp/site:/tmp/site2 python3 -c "import vllm, jwt; print('vllm', vllm.__version__, 'jwt', jwt.__version__)"
    ;;
  env)
    src="$here/src"
    [ -d "$here/.gpu-stage/src/src" ] && src="$here/.gpu-stage/src/src"
    echo "export PYTHONPATH=$src:/tmp/site:/tmp/site2:/tmp/site3 PYTHONHASHSEED=0 VLLM_USE_FLASHINFER_SAMPLER=0" \
         "VLLM_NO_USAGE_STATS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1"
    ;;
  *)
    echo "usage: stage.sh bundle | src | nixl | recv c1|c2|c3 | install | install-nixl | env" >&2
    exit 2
    ;;
esac

#!/usr/bin/env bash
# Stage vLLM 0.25.0 (+ its missing dependencies and PyJWT) onto the offline GPU host, in two
# transfers of < 64 MiB each. See bench/gpu/stage.md for the whole procedure and timings.
#
#   here:  bash bench/gpu/stage.sh bundle          # -> .gpu-stage/c1 (60 MiB), .gpu-stage/c2 (~57 MB)
#   host:  bash bench/gpu/stage.sh recv c1         # copy a carried part to /tmp/stage
#   host:  bash bench/gpu/stage.sh recv c2
#   host:  bash bench/gpu/stage.sh install         # /tmp/site (vllm), /tmp/site2 (wheels)
#   host:  eval "$(bash bench/gpu/stage.sh env)"   # PYTHONPATH and vLLM variables
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
    echo "export PYTHONPATH=$here/src:/tmp/site:/tmp/site2 PYTHONHASHSEED=0 VLLM_USE_FLASHINFER_SAMPLER=0" \
         "VLLM_NO_USAGE_STATS=1 VLLM_ENABLE_V1_MULTIPROCESSING=0 PYTHONUNBUFFERED=1"
    ;;
  *)
    echo "usage: stage.sh bundle | recv c1|c2 | install | env" >&2
    exit 2
    ;;
esac

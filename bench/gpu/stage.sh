#!/usr/bin/env bash
# Stage vLLM 0.25.0 (+ its missing dependencies, PyJWT, and what `vllm serve` needs beyond the
# offline engine: uvicorn & co) onto the offline GPU host, in three transfers of < 64 MiB each
# (with the working tree, ~5 MB, which travels with every call).
# See bench/gpu/stage.md for the whole procedure and timings.
#
#   here:  bash bench/gpu/stage.sh bundle          # -> .gpu-stage/c1 (vLLM 1/2, 55 MiB), c2 (vLLM 2/2 + serve
#                                                  #    wheels, 42 MiB), c3/wheels (dependency wheels, 19 MiB)
#   host:  bash bench/gpu/stage.sh recv c1         # copy a carried part to /tmp/stage
#   host:  bash bench/gpu/stage.sh probe           # which of the API server's imports the host lacks (no vLLM needed)
#   host:  bash bench/gpu/stage.sh recv c2         # (carry .gpu-stage/src with it)
#   host:  bash bench/gpu/stage.sh recv c3
#   host:  bash bench/gpu/stage.sh install         # /tmp/site (vllm), /tmp/site2 (wheels); checks the API server imports
#   host:  eval "$(bash bench/gpu/stage.sh env)"   # PYTHONPATH and vLLM variables
#   here:  bash bench/gpu/stage.sh src             # HEAD's src/ bench/ README.md -> .gpu-stage/src (carry it; the
#                                                  # env line then puts .gpu-stage/src/src first on PYTHONPATH)
# Optional, for the RDMA transport over UCX cma (same-host nodes; no NIC on the lent host):
#   here:  bash bench/gpu/stage.sh nixl            # -> .gpu-stage/c3/nixl.tar.gz (nixl-cu12 for cp312, 30 MB)
#   host:  bash bench/gpu/stage.sh install-nixl    # after recv c3 -> /tmp/site3
set -euo pipefail
here=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
stage=${STAGE_DIR:-/tmp/stage}

case "${1:-}" in
  bundle)
    out="$here/.gpu-stage"
    mb=${MAKE_BUNDLE:-$here/bench/gpu/make_bundle.sh}  # the team's GPU recipe, kept here so the repo stands alone
    [ -d "$out/bundle" ] || bash "$mb" "$out/bundle"
    rm -rf "$out/c1" "$out/c2" "$out/c3/wheels"
    mkdir -p "$out/c1" "$out/c2" "$out/c3/wheels"
    # Re-split the vLLM tree (tar.gz) into a 55 MiB part and the rest (42 MiB, with the serve
    # wheels and .gpu-stage/src); the dependency wheels go in c3, beside NIXL. Each call keeps
    # ~6 MB for the working tree (5 MB on 2026-12-03) under the 64 MiB.
    cat "$out"/bundle/vllm.part.* | split -b 55m - "$out/c1/vllm.part."
    mv "$out/c1/vllm.part.ab" "$out/c2/"
    cp "$out"/bundle/wheels/*.whl "$out/c3/wheels/"
    # memkv's own runtime dependency missing from the host image (license.py imports jwt).
    python3 -m pip download -q --no-deps --only-binary=:all: -d "$out/c3/wheels" PyJWT==2.15.1
    # `vllm serve`: the imports of vllm.entrypoints.openai.api_server (build_app, the completions
    # route, uvicorn's runtime protocol) that the offline LLM path never needed, found by importing
    # them against vLLM 0.25.0 (stage.md). Installed on the host only where it lacks the module
    # (install: never shadows a package of the host image).
    mkdir -p "$out/c2/serve-wheels"
    plat="--platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64
          --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform any"
    for pkg in uvicorn==0.54.0 h11==0.16.0 click==8.5.1 watchfiles==1.3.0 anyio==4.16.0 \
        prometheus-fastapi-instrumentator==8.1.0 model-hosting-container-standards==0.1.16 jmespath==1.1.0; do
      python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp $plat \
        -d "$out/c2/serve-wheels" "$pkg"
    done
    # What c2 and c3 will bring, by import name (for `probe` in the call that carries c1).
    python3 - "$out" "$out/c1/MANIFEST.json" <<'PY'
import glob, json, os, sys, zipfile
c2, dst = sys.argv[1], sys.argv[2]
man = {}
for whl in sorted(glob.glob(os.path.join(c2, "c[23]", "*wheels", "*.whl"))):
    tops = set()
    with zipfile.ZipFile(whl) as z:
        for n in z.namelist():
            first = n.split("/")[0]
            if first.endswith((".dist-info", ".data")) or first.startswith("_"):
                continue
            tops.add(first[:-3] if first.endswith(".py") else first.split(".")[0])
    man[os.path.relpath(whl, c2)] = sorted(tops)
json.dump(man, open(dst, "w"), indent=1)
PY
    du -sb "$out"/c1 "$out"/c2 "$out"/c3/wheels
    ;;
  src)
    # The committed src/ and bench/ (git archive HEAD), for `carry`: a run then measures exactly
    # a commit, whatever is being edited in the working tree meanwhile.
    out="$here/.gpu-stage/src"
    rm -rf "$out" && mkdir -p "$out"
    git -C "$here" archive HEAD src bench README.md setup.py pyproject.toml csrc | tar -x -C "$out"  # README.md: serve.py --readme
    rm -rf "$out/bench/gpu/results" "$out/bench/results"  # raw results: not needed there, and c2 + src must stay < 64 MiB
    # The compiled receive loop (memkv._recv_verify, stable ABI): built here, it loads on the
    # host's Python 3.12; MEMKV_PURE_PYTHON=1 there measures the pure-Python loop instead.
    (cd "$out" && python3 setup.py -q build_ext --inplace >/dev/null 2>&1 && rm -rf build) \
      || echo "stage.sh src: memkv._recv_verify not built (no compiler?): the host runs pure Python" >&2
    git -C "$here" rev-parse --short HEAD > "$out/COMMIT"
    echo "$out: $(cat "$out/COMMIT")"
    ;;
  nixl)
    # nixl-cu12's cp312 wheel is 69 MB; 38 MB of it is nixl_ep (expert-parallel kernels MemKV
    # never imports). Ship the rest as a plain tree: a wheel is a zip of site-packages content.
    out="$here/.gpu-stage/c3"
    mkdir -p "$out" && rm -f "$out/nixl.tar.gz"
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
    du -b "$out/nixl.tar.gz"
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
  probe)
    # Host dependency probe (needs neither vLLM nor c2): which modules of the `vllm serve` import
    # path the host image lacks, and whether c2 brings them.
    python3 "$here/bench/gpu/hostprobe.py" "$stage/MANIFEST.json"
    ;;
  install)
    mkdir -p /tmp/site /tmp/site2
    cat "$stage"/vllm.part.* | tar -xzf - -C /tmp/site
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
      --target /tmp/site2 "$stage"/wheels/*.whl
    # Serve wheels: only those whose module the host (with /tmp/site*) lacks.
    need=()
    for whl in "$stage"/serve-wheels/*.whl; do
      mod=$(basename "$whl" | cut -d- -f1 | tr 'A-Z-' 'a-z_')
      PYTHONPATH=/tmp/site:/tmp/site2 python3 -c "import importlib.util, sys; sys.exit(importlib.util.find_spec('$mod') is not None)" \
        && need+=("$whl")
    done
    if [ ${#need[@]} -gt 0 ]; then
      echo "serve wheels installed (missing on the host): $(for w in "${need[@]}"; do basename "$w" | cut -d- -f1-2; done | tr '\n' ' ')"
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site2 "${need[@]}"
    fi
    PYTHONPATH=/tmp/site:/tmp/site2 python3 -c "import vllm, jwt; print('vllm', vllm.__version__, 'jwt', jwt.__version__)"
    # What `vllm serve` imports at startup: fails the install (rc != 0) with the missing module named.
    if ! out=$(PYTHONPATH=/tmp/site:/tmp/site2 python3 -c "import vllm.entrypoints.openai.api_server, vllm.entrypoints.cli.main, uvicorn, h11
print('api_server ok; uvicorn', uvicorn.__version__)" 2>&1); then
      echo "$out" | grep -v "^INFO\|^DEBUG" | tail -15
      echo "stage.sh install: vllm serve's imports FAIL on this host (above)" >&2
      exit 1
    fi
    echo "$out" | tail -1
    ;;
  env)
    src="$here/src"
    [ -d "$here/.gpu-stage/src/src" ] && src="$here/.gpu-stage/src/src"
    # No VLLM_ENABLE_V1_MULTIPROCESSING: ttft.py sets it per engine (default: vLLM's own layout,
    # --inproc: 0) and serve.py leaves it unset, as a user's shell would.
    echo "export PYTHONPATH=$src:/tmp/site:/tmp/site2:/tmp/site3 PYTHONHASHSEED=0 VLLM_USE_FLASHINFER_SAMPLER=0" \
         "VLLM_NO_USAGE_STATS=1 PYTHONUNBUFFERED=1; unset VLLM_ENABLE_V1_MULTIPROCESSING"
    ;;
  *)
    echo "usage: stage.sh bundle | src | nixl | recv c1|c2|c3 | probe | install | install-nixl | env" >&2
    exit 2
    ;;
esac

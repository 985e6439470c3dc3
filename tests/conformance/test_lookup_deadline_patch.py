"""The patches/ lookup-deadline patch bounds a stalled secondary-tier lookup.

Behaviour under test: with the shipped patch for the installed vLLM applied, an fs-tier
lookup whose existence probe is stalled answers RETRY until ``lookup_timeout_s`` has
passed and MISS from then on (within one step), and a later lookup of another chunk is
served (HIT) while the first probe is still stuck; shutdown does not wait for the stuck
probe; ``lookup_timeout_s: 0`` turns the deadline off. Negative control: on the
unpatched release the same stalled lookup is still RETRY after the same time, and so is
the later lookup (the tier's single lookup worker is stuck). Exactly one shipped patch
applies to each covered release.

The venv's vLLM is never modified: the patched run uses an overlay (a symlink copy of the
installed package with the patched files as real copies) placed first on sys.path of a
subprocess. Each scenario runs in its own subprocess, which also runs this file as a
script (``python -m tests.conformance.test_lookup_deadline_patch``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import inspect
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="conformance tests need vLLM (run them through nox)")

pytestmark = pytest.mark.conformance

REPO_ROOT = Path(__file__).resolve().parents[2]
PATCH_DIR = REPO_ROOT / "patches"
# Which shipped patch applies to which release (patches/README.md has the same table).
PATCH_FOR_RELEASE = {
    "0.25.0": "vllm-0.25-async-lookup-deadline.patch",
    "0.25.1": "vllm-0.25-async-lookup-deadline.patch",
    "0.26.0": "vllm-0.26-async-lookup-deadline.patch",
    "0.27.0": "vllm-0.26-async-lookup-deadline.patch",
    "0.27.1": "vllm-0.26-async-lookup-deadline.patch",
    "0.28.0": "vllm-0.28-async-lookup-deadline.patch",
    "0.29.0": "vllm-0.28-async-lookup-deadline.patch",
    "0.30.0": "vllm-0.30-async-lookup-deadline.patch",
    "0.31.0": "vllm-0.31-async-lookup-deadline.patch",
    "0.32.0": "vllm-0.31-async-lookup-deadline.patch",
    "0.33.0": "vllm-0.33-async-lookup-deadline.patch",
    "0.34.0": "vllm-0.34-async-lookup-deadline.patch",
}

LOOKUP_TIMEOUT_S = 1.0
OBSERVE_S = LOOKUP_TIMEOUT_S + 1.5  # how long each scenario lookup is watched at most
ONE_STEP_SLACK_S = 0.75  # a 10 ms step plus scheduling noise on a loaded 2-core box
STALL_S = 30.0  # a stalled probe gives up on its own after this, whatever happens
SUBPROCESS_TIMEOUT_S = 180.0


# -- the scenario (runs in a subprocess) ------------------------------------------------


def run_scenario(root_dir: str, lookup_timeout_s: float | None) -> dict:
    """Stall the fs probe of one stored chunk, look it up, then look up another chunk.

    ``lookup_timeout_s`` None leaves the key out of the tier dict (the unpatched fs tier
    rejects it); 0 disables the patched deadline.
    """
    import vllm
    from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
    from vllm.v1.kv_offload.tiering.fs.manager import FsAsyncLookupManager

    from tests.conformance.vllm_harness import HeadlessEngine, make_keys

    release_stall = threading.Event()
    stalled_keys: set[bytes] = set()
    original_batch_lookup = FsAsyncLookupManager.batch_lookup

    def stalling_batch_lookup(self, keys, req_context):
        if stalled_keys.intersection(keys):
            release_stall.wait(STALL_S)
        return original_batch_lookup(self, keys, req_context)

    FsAsyncLookupManager.batch_lookup = stalling_batch_lookup

    tier = {
        "type": "fs",
        "root_dir": root_dir,
        "n_read_threads": 2,
        "n_write_threads": 2,
    }
    if lookup_timeout_s is not None:
        tier["lookup_timeout_s"] = lookup_timeout_s
    engine = HeadlessEngine([tier])
    try:
        stuck_key, later_key = make_keys(2)
        writer = engine.new_request()
        engine.store_chunks(writer, [stuck_key, later_key])
        engine.finish_request(writer)
        engine.step()
        engine.run_until_idle()
        engine.fill_pool_to_evict([stuck_key, later_key])

        stalled_keys.add(stuck_key)
        bounds = {"max_steps": 100_000, "timeout_s": OBSERVE_S, "poll_s": 0.01}
        stuck = engine.lookup_until_resolved([stuck_key], engine.new_request(), **bounds)
        later = engine.lookup_until_resolved([later_key], engine.new_request(), **bounds)
        probe_still_stalled = not release_stall.is_set()
    finally:
        if not lookup_timeout_s or lookup_timeout_s <= 0:
            release_stall.set()  # without a deadline, shutdown joins the stuck worker
        start = time.monotonic()
        engine.shutdown()
        shutdown_s = time.monotonic() - start
        release_stall.set()

    param = inspect.signature(AsyncLookupManager.__init__).parameters.get("lookup_timeout_s")
    return {
        "vllm_file": vllm.__file__,
        "default_lookup_timeout_s": None if param is None else param.default,
        "stuck": _trace_json(stuck),
        "later": _trace_json(later),
        "probe_still_stalled": probe_still_stalled,
        "shutdown_s": shutdown_s,
    }


def _trace_json(trace) -> dict:
    return {
        "first": trace.steps[0][0].name,
        "final": trace.final[0].name,
        "resolved": trace.resolved,
        "elapsed_s": trace.elapsed_s,
        "summary": trace.summary(),
    }


# -- helpers (run in pytest) -----------------------------------------------------------


def installed_vllm_dir() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.submodule_search_locations
    return Path(next(iter(spec.submodule_search_locations)))


def patched_paths(patch_file: Path) -> list[str]:
    """Paths (relative to site-packages) the patch modifies, from its +++ lines."""
    lines = patch_file.read_text().splitlines()
    return [line.split()[1].split("/", 1)[1] for line in lines if line.startswith("+++ ")]


def apply_patch(patch_file: Path, tree: Path, dry_run: bool = False) -> subprocess.CompletedProcess:
    args = [
        "patch",
        "-p1",
        "--fuzz=0",
        "--batch",
        "--forward",
        "--no-backup-if-mismatch",
    ]
    args += ["-d", str(tree)]
    return subprocess.run(
        args + (["--dry-run"] if dry_run else []),
        input=patch_file.read_text(),
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )


def copy_patched_files(patch_file: Path, dest: Path) -> None:
    """Real copies of the installed files the patch touches, under dest/vllm/..."""
    site = installed_vllm_dir().parent
    for rel in patched_paths(patch_file):
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        (dest / rel).unlink(missing_ok=True)
        shutil.copy2(site / rel, dest / rel)


def build_overlay(patch_file: Path, dest: Path) -> Path:
    """dest/vllm: symlinks to the installed package, the patched files real and patched."""
    shutil.copytree(
        installed_vllm_dir(),
        dest / "vllm",
        copy_function=os.symlink,
        ignore=shutil.ignore_patterns("__pycache__"),
    )
    copy_patched_files(patch_file, dest)
    result = apply_patch(patch_file, dest)
    assert result.returncode == 0, f"{patch_file.name} failed:\n{result.stdout}{result.stderr}"
    return dest


def run_in_subprocess(root_dir: Path, overlay: Path | None, lookup_timeout_s: float | None):
    env = dict(os.environ, PYTHONHASHSEED="0")
    env["PYTHONPATH"] = os.pathsep.join([str(p) for p in (overlay, REPO_ROOT) if p] + [env.get("PYTHONPATH", "")])
    args = [
        sys.executable,
        "-m",
        "tests.conformance.test_lookup_deadline_patch",
        "--root-dir",
        str(root_dir),
    ]
    if lookup_timeout_s is not None:
        args += ["--lookup-timeout-s", str(lookup_timeout_s)]
    proc = subprocess.run(
        args,
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        check=False,
    )
    assert proc.returncode == 0, f"scenario failed:\n{proc.stdout[-4000:]}{proc.stderr[-8000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def release_patch() -> Path:
    release = importlib.metadata.version("vllm")
    name = PATCH_FOR_RELEASE.get(release)
    if name is None:
        covered = ", ".join(PATCH_FOR_RELEASE)
        pytest.skip(
            f"no shipped lookup-deadline patch covers vLLM {release} (covered: {covered}; see patches/README.md)"
        )
    return PATCH_DIR / name


# -- tests ------------------------------------------------------------------------------


def test_exactly_the_listed_patch_applies_to_the_installed_release(release_patch, tmp_path):
    applies = []
    for patch_file in sorted(PATCH_DIR.glob("*.patch")):
        tree = tmp_path / patch_file.stem
        copy_patched_files(patch_file, tree)
        if apply_patch(patch_file, tree, dry_run=True).returncode == 0:
            applies.append(patch_file.name)
    assert applies == [release_patch.name]


def test_patched_stalled_lookup_resolves_miss_at_the_deadline_and_later_lookups_still_hit(release_patch, tmp_path):
    overlay = build_overlay(release_patch, tmp_path / "overlay")
    out = run_in_subprocess(tmp_path / "fs", overlay, LOOKUP_TIMEOUT_S)

    assert out["vllm_file"].startswith(str(overlay)), "subprocess did not import the overlay"
    assert out["default_lookup_timeout_s"] == 5.0
    stuck, later = out["stuck"], out["later"]
    assert (stuck["first"], stuck["final"]) == ("RETRY", "MISS"), stuck
    assert LOOKUP_TIMEOUT_S <= stuck["elapsed_s"] <= LOOKUP_TIMEOUT_S + ONE_STEP_SLACK_S, stuck
    # Served while the first probe is still blocked: the worker gave up on it.
    assert out["probe_still_stalled"]
    assert later["final"] == "HIT" and later["elapsed_s"] < LOOKUP_TIMEOUT_S, later
    assert out["shutdown_s"] < LOOKUP_TIMEOUT_S + ONE_STEP_SLACK_S, out


def test_unpatched_stalled_lookup_is_still_retry_after_the_same_time(release_patch, tmp_path):
    out = run_in_subprocess(tmp_path / "fs", None, None)

    assert out["default_lookup_timeout_s"] is None, "the venv's vLLM looks patched"
    stuck, later = out["stuck"], out["later"]
    assert not stuck["resolved"] and stuck["final"] == "RETRY", stuck
    assert stuck["elapsed_s"] >= LOOKUP_TIMEOUT_S + ONE_STEP_SLACK_S, stuck
    # The tier's one lookup worker is stuck in the first probe, so this waits too.
    assert not later["resolved"] and later["final"] == "RETRY", later


def test_patched_with_the_deadline_disabled_stalled_lookup_stays_retry(release_patch, tmp_path):
    overlay = build_overlay(release_patch, tmp_path / "overlay")
    out = run_in_subprocess(tmp_path / "fs", overlay, 0.0)

    stuck = out["stuck"]
    assert not stuck["resolved"] and stuck["final"] == "RETRY", stuck
    assert stuck["elapsed_s"] >= LOOKUP_TIMEOUT_S + ONE_STEP_SLACK_S, stuck


def main() -> None:
    parser = argparse.ArgumentParser(description="lookup-deadline scenario (subprocess)")
    parser.add_argument("--root-dir", required=True)
    parser.add_argument("--lookup-timeout-s", type=float, default=None)
    args = parser.parse_args()
    result = run_scenario(args.root_dir, args.lookup_timeout_s)
    print(json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

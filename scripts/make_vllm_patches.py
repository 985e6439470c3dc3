"""Generate the lookup-deadline patches from pristine wheel sources.

usage: python scripts/make_vllm_patches.py SRC_ROOT patches/ [STEM ...]
(STEM, e.g. vllm-0.34: only those patches; default: all)
(unpack each release first: pip download --no-deps vllm==<release>, then unzip the
wheel into SRC_ROOT/<release>/)
SRC_ROOT/<release>/vllm/v1/kv_offload/... are the unpacked wheels.
"""

import os
import subprocess
import sys

ASYNC = "vllm/v1/kv_offload/tiering/async_lookup.py"
FS = "vllm/v1/kv_offload/tiering/fs/manager.py"

# patch file stem -> (representative release, releases it must apply to)
GROUPS = {
    "vllm-0.25": ("0.25.0", ["0.25.0", "0.25.1"]),
    "vllm-0.26": ("0.26.0", ["0.26.0", "0.27.0", "0.27.1"]),
    "vllm-0.28": ("0.28.0", ["0.28.0", "0.29.0"]),
    "vllm-0.30": ("0.30.0", ["0.30.0"]),
    "vllm-0.31": ("0.31.0", ["0.31.0", "0.32.0"]),
    "vllm-0.33": ("0.33.0", ["0.33.0"]),
    "vllm-0.34": ("0.34.0", ["0.34.0"]),
}


def sub(text, old, new, count=1):
    n = text.count(old)
    assert n == count, f"expected {count} of {old!r}, found {n}"
    return text.replace(old, new)


DOC_SECTION = '''
Lookup deadline
---------------
A lookup that has no verdict ``lookup_timeout_s`` seconds (default
DEFAULT_LOOKUP_TIMEOUT_S; <= 0 disables) after it was first asked resolves
as a miss (False) instead of staying None (RETRY) forever; a verdict the
worker posts later for that state is dropped.  The worker runs
batch_lookup() on a helper thread and gives up on a call that overruns the
same timeout: the keys of that call resolve False and the helper thread is
abandoned (it exits once the call returns), so one stuck probe cannot hold
back every later lookup of the tier.
'''

PROBE_THREAD = '''

class _ProbeThread:
    """Runs batch_lookup() calls for the worker on a replaceable daemon thread.

    call() is used by the worker thread only. A call that overruns its timeout
    raises TimeoutError; the thread running it is abandoned (told to exit once
    the call returns) and a fresh one serves later calls. An abandoned thread
    holds nothing but its stuck call.
    """

    def __init__(self, name: str) -> None:
        self._name = name
        self._inbox = self._spawn()

    def _spawn(self) -> "queue.SimpleQueue":
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        threading.Thread(
            target=self._serve, args=(inbox,), name=self._name, daemon=True
        ).start()
        return inbox

    @staticmethod
    def _serve(inbox: "queue.SimpleQueue") -> None:
        while (item := inbox.get()) is not None:
            fn, outbox = item
            try:
                outbox.put((True, fn()))
            except Exception as exc:
                outbox.put((False, exc))

    def call(self, fn: Callable[[], list[bool]], timeout_s: float) -> list[bool]:
        outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._inbox.put((fn, outbox))
        try:
            ok, value = outbox.get(timeout=timeout_s)
        except queue.Empty:
            self._inbox.put(None)  # the stuck thread exits after its call returns
            self._inbox = self._spawn()
            raise TimeoutError(
                f"batch_lookup did not return within {timeout_s:.1f} s"
            ) from None
        if not ok:
            raise value
        return value

    def stop(self) -> None:
        self._inbox.put(None)
'''

INIT_STATE = '''        self._tier_type = tier_type
        self._lookup_timeout_s = float(lookup_timeout_s)
        # Lookups the deadline resolved since the last warning; scheduler-owned.
        self._num_timed_out = 0
        # Set by shutdown() so the worker skips batches still queued (each one
        # could otherwise wait a full timeout on a stuck backend).
        self._stopping = threading.Event()
        # Runs batch_lookup() so the worker can stop waiting for a stuck call.
        self._probe = (
            _ProbeThread(f"vllm_offloading_probe_{tier_type}")
            if self._lookup_timeout_s > 0
            else None
        )
'''

HELPERS = '''    def _new_deadline(self) -> float:
        if self._lookup_timeout_s <= 0:
            return math.inf
        return time.monotonic() + self._lookup_timeout_s

    def _time_out(self, state: LookupState) -> None:
        """Resolve a lookup whose deadline passed without a verdict as a miss."""
        state.result = False
        state.timed_out = True{phase}
        self._num_timed_out += 1

    def _report_timeouts(self) -> None:
        if self._num_timed_out:
            logger.warning(
                "%d lookups on tier %s got no answer within %.1f s; "
                "treating them as misses",
                self._num_timed_out,
                self._tier_type,
                self._lookup_timeout_s,
            )
            self._num_timed_out = 0

    def _bounded_batch_lookup(
        self, keys: list[OffloadKey], req_context: ReqContext
    ) -> list[bool]:
        """batch_lookup(), materialized and bounded by the lookup timeout.

        Runs on the worker thread; raises TimeoutError when the call overruns.
        """

        def probe() -> list[bool]:
            return list(self.batch_lookup(keys, req_context))

        if self._probe is None:  # lookup_timeout_s <= 0: no deadline
            return probe()
        return self._probe.call(probe, self._lookup_timeout_s)

    def _worker(self) -> None:
'''

STATE_FIELDS = '''    # Monotonic time after which a lookup still without a verdict resolves
    # as a miss; math.inf when the deadline is disabled.
    deadline: float = math.inf
    # True once the deadline, not the worker, decided the result.
    timed_out: bool = False
'''


def patch_async(text, release):
    generations = "LookupPhase" in text  # 0.30+
    text = sub(text, '\n"""\n\nimport queue\n', "\n" + DOC_SECTION + '"""\n\nimport math\nimport queue\n')
    text = sub(text, "import threading\n", "import threading\nimport time\n")
    text = sub(text, "from collections.abc import ", "from collections.abc import Callable, ")
    text = sub(
        text,
        "logger = init_logger(__name__)\n",
        "logger = init_logger(__name__)\n\n"
        "# Seconds a lookup may stay without a verdict (RETRY) before it resolves as a\n"
        "# miss, unless the tier passes its own lookup_timeout_s; <= 0 disables it.\n"
        "DEFAULT_LOOKUP_TIMEOUT_S = 5.0\n",
    )
    # LookupState fields, then the probe thread class after LookupState.
    marker = "    request_ids: set[str] = field(default_factory=set)  # requests asking for the lookup\n"
    text = sub(text, marker, marker + STATE_FIELDS + PROBE_THREAD)
    text = sub(
        text,
        "        tier_type: str,\n    ) -> None:\n        self._tier_type = tier_type\n",
        "        tier_type: str,\n        lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,\n"
        "    ) -> None:\n" + INIT_STATE,
    )
    text = sub(text, "        return state.result\n",
               "        if state.result is None and time.monotonic() >= state.deadline:\n"
               "            self._time_out(state)\n"
               "        return state.result\n")
    phase = "\n        state.phase = LookupPhase.RESOLVED" if generations else ""
    text = sub(text, "    def _worker(self) -> None:\n", HELPERS.format(phase=phase))
    # The worker: skip queued batches at shutdown, bounded probe call.
    text = sub(text,
               "            if pending is None:\n                break\n",
               "            if pending is None:\n                break\n"
               "            if self._stopping.is_set():\n                continue\n")
    text = sub(text,
               "        self._lookup_queue.put(None)  # unblock _worker from _lookup_queue.get()\n"
               "        self._thread.join()\n",
               "        self._stopping.set()\n"
               "        self._lookup_queue.put(None)  # unblock _worker from _lookup_queue.get()\n"
               "        self._thread.join()\n"
               "        if self._probe is not None:\n"
               "            self._probe.stop()\n")
    if "list(self.batch_lookup(keys, req_context))" in text.split("def _worker")[1]:
        text = sub(text,
                   "                    hits: Iterable[bool] = list(self.batch_lookup(keys, req_context))\n",
                   "                    hits: Iterable[bool] = self._bounded_batch_lookup(\n"
                   "                        keys, req_context\n"
                   "                    )\n")
    else:
        text = sub(text,
                   "                    hits = self.batch_lookup(keys, req_context)\n",
                   "                    hits = self._bounded_batch_lookup(keys, req_context)\n")

    if generations:
        text = sub(text,
                   "            state = LookupState(generation=self._next_generation)\n",
                   "            state = LookupState(\n"
                   "                generation=self._next_generation, deadline=self._new_deadline()\n"
                   "            )\n")
        # flush(): an entry the deadline resolved before it was sent stays resolved.
        text = sub(text,
                   "            if state is None or state.generation != generation:\n"
                   "                continue\n"
                   "            assert state.phase is LookupPhase.PENDING\n",
                   "            if state is None or state.generation != generation:\n"
                   "                continue\n"
                   "            if state.timed_out:  # resolved by its deadline before it was sent\n"
                   "                continue\n"
                   "            assert state.phase is LookupPhase.PENDING\n")
        # drain_results(): the deadline already answered; drop the late verdict.
        text = sub(text,
                   "                if state is None or state.generation != generation:\n"
                   "                    continue\n"
                   "                if not state.request_ids:\n",
                   "                if state is None or state.generation != generation:\n"
                   "                    continue\n"
                   "                if state.timed_out:  # the deadline answered first\n"
                   "                    continue\n"
                   "                if not state.request_ids:\n")
        text = sub(text, "        self.drain_results()\n        self._need_to_drain = True\n",
                   "        self.drain_results()\n        self._report_timeouts()\n"
                   "        self._need_to_drain = True\n")
    else:
        # 0.25-0.29 match results to keys only: tag each probe with the state that
        # sent it, so a late verdict cannot land on a state that cleanup() replaced
        # or that its deadline already decided.
        text = sub(text,
                   "            state = LookupState()\n"
                   "            self._lookup_state[key] = state\n"
                   "            self._lookup_batch.append((key, req_context))\n",
                   "            state = LookupState(deadline=self._new_deadline())\n"
                   "            self._lookup_state[key] = state\n"
                   "            self._lookup_batch.append((key, req_context, state))\n")
        text = sub(text,
                   "        self._lookup_batch: list[tuple[OffloadKey, ReqContext]] = []\n",
                   "        self._lookup_batch: list[tuple[OffloadKey, ReqContext, LookupState]] = []\n")
        text = sub(text,
                   "            list[tuple[OffloadKey, ReqContext]] | None\n",
                   "            list[tuple[OffloadKey, ReqContext, LookupState]] | None\n")
        text = sub(text,
                   "        # Each item is a list of (key, found) pairs.\n",
                   "        # Each item is a list of (key, state that asked, found) triples.\n")
        text = sub(text,
                   "        self._pending_results: queue.SimpleQueue[list[tuple[OffloadKey, bool]]] = (\n"
                   "            queue.SimpleQueue()\n"
                   "        )\n",
                   "        self._pending_results: queue.SimpleQueue[\n"
                   "            list[tuple[OffloadKey, LookupState, bool]]\n"
                   "        ] = queue.SimpleQueue()\n")
        text = sub(text,
                   "        self._need_to_drain = True\n        if self._lookup_batch:\n",
                   "        self._report_timeouts()\n"
                   "        self._need_to_drain = True\n        if self._lookup_batch:\n")
        text = sub(text,
                   "            for key, result in batch:\n"
                   "                state = self._lookup_state.get(key)\n"
                   "                if state is not None:\n",
                   "            for key, sent_by, result in batch:\n"
                   "                state = self._lookup_state.get(key)\n"
                   "                # Only the state that sent the probe takes its verdict, and\n"
                   "                # only if its deadline has not answered already.\n"
                   "                if state is sent_by and not state.timed_out:\n")
        text = sub(text,
                   "            batches: dict[str, tuple[ReqContext, list[OffloadKey]]] = {}\n"
                   "            for key, req_context in pending:\n",
                   "            batches: dict[\n"
                   "                str, tuple[ReqContext, list[tuple[OffloadKey, LookupState]]]\n"
                   "            ] = {}\n"
                   "            for key, req_context, state in pending:\n")
        text = sub(text,
                   "                batches[req_id][1].append(key)\n",
                   "                batches[req_id][1].append((key, state))\n")
        text = sub(text,
                   "            results: list[tuple[OffloadKey, bool]] = []\n"
                   "            for req_context, keys in batches.values():\n",
                   "            results: list[tuple[OffloadKey, LookupState, bool]] = []\n"
                   "            for req_context, entries in batches.values():\n"
                   "                keys = [key for key, _ in entries]\n")
        text = sub(text,
                   "                for key, hit in zip(keys, hits):\n"
                   "                    results.append((key, hit))\n",
                   "                for (key, sent_by), hit in zip(entries, hits):\n"
                   "                    results.append((key, sent_by, hit))\n")
    return text


def patch_fs(text):
    text = sub(text,
               "from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager\n",
               "from vllm.v1.kv_offload.tiering.async_lookup import (\n"
               "    DEFAULT_LOOKUP_TIMEOUT_S,\n"
               "    AsyncLookupManager,\n"
               ")\n")
    text = sub(text,
               '        tier: "FileSystemTierManager",\n'
               "        tier_type: str,\n"
               "    ) -> None:\n"
               "        super().__init__(tier_type=tier_type)\n",
               '        tier: "FileSystemTierManager",\n'
               "        tier_type: str,\n"
               "        lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,\n"
               "    ) -> None:\n"
               "        super().__init__(tier_type=tier_type, lookup_timeout_s=lookup_timeout_s)\n")
    # Last parameter of FileSystemTierManager.__init__ (keyword use only, as the
    # factory passes every tier-dict key by name).
    cls_at = text.index("class FileSystemTierManager")
    sig_at = text.index("    def __init__(\n", cls_at)
    end_at = text.index("\n    ):\n", sig_at)
    text = (text[:end_at] + "\n        lookup_timeout_s: float = DEFAULT_LOOKUP_TIMEOUT_S,"
            + text[end_at:])
    doc_line_at = text.index("n_write_threads: Number of write-priority I/O threads.\n", end_at)
    line_start = text.rindex("\n", 0, doc_line_at) + 1
    indent = text[line_start:doc_line_at]
    line_end = text.index("\n", doc_line_at) + 1
    text = (text[:line_end]
            + f"{indent}lookup_timeout_s: Seconds a lookup may go unanswered before it\n"
            + f"{indent}    counts as a miss; <= 0 waits forever.\n"
            + text[line_end:])
    text = sub(text,
               "        self._lookup_manager = FsAsyncLookupManager(tier=self, tier_type=self.tier_type)\n",
               "        self._lookup_manager = FsAsyncLookupManager(\n"
               "            tier=self, tier_type=self.tier_type, lookup_timeout_s=lookup_timeout_s\n"
               "        )\n")
    return text


def main(src_root, out_dir, stems=()):
    work = "/tmp/patchwork/trees"
    unknown = set(stems) - set(GROUPS)
    assert not unknown, f"unknown patch stems {sorted(unknown)}; known: {sorted(GROUPS)}"
    for stem, (rep, releases) in GROUPS.items():
        if stems and stem not in stems:
            continue
        a = os.path.join(work, stem, "a")
        b = os.path.join(work, stem, "b")
        chunks = []
        for rel, fn in ((ASYNC, patch_async), (FS, patch_fs)):
            orig = open(os.path.join(src_root, rep, rel)).read()
            new = fn(orig, rep) if fn is patch_async else fn(orig)
            for root, content in ((a, orig), (b, new)):
                os.makedirs(os.path.dirname(os.path.join(root, rel)), exist_ok=True)
                with open(os.path.join(root, rel), "w") as f:
                    f.write(content)
            diff = subprocess.run(
                ["diff", "-u", "--label", f"a/{rel}", "--label", f"b/{rel}",
                 os.path.join(a, rel), os.path.join(b, rel)],
                capture_output=True, text=True,
            )
            assert diff.returncode == 1, diff.stderr
            chunks.append(diff.stdout)
        out = os.path.join(out_dir, f"{stem}-async-lookup-deadline.patch")
        with open(out, "w") as f:
            f.write("".join(chunks))
        print(out, releases)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3:])

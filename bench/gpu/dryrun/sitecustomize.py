"""Dry run of bench/gpu/ttft.py without a GPU: with this folder first on PYTHONPATH and
TTFT_FAKE_LLM=1, `vllm.LLM` becomes a stand-in built on the conformance suite's headless
harness (tests/conformance/vllm_harness.py): vLLM's real TieringOffloadingManager and the real
memkv/fs tiers, real `memkv serve` nodes, no model (outputs are a hash of the prompt). It checks
the script's flow (phases, reset, settle, tier instrumentation, sweep, JSON, table) before
spending device time; its timings mean nothing. See bench/gpu/stage.md.

With VLLM_ENABLE_V1_MULTIPROCESSING other than "0" (ttft.py's default layout) the stand-in
also plays the separate engine-core process: a background thread steps the manager while it
has pending work, as EngineCoreProc's busy loop does, and nothing is reached through
llm_engine (ttft.py must not need it there).
"""

import os

if os.environ.get("TTFT_FAKE_LLM"):
    import hashlib
    import sys
    import time
    from types import SimpleNamespace as NS

    sys.path.insert(
        0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "tests", "conformance")
    )
    import threading

    import vllm
    import vllm_harness as H
    from vllm.v1.kv_offload.base import LookupResult

    class FakeLLM:
        def __init__(self, model, kv_transfer_config, **kw):
            from vllm.plugins import load_general_plugins

            load_general_plugins()  # as every vLLM process does (the entry points of ttft.py's dist-info)
            extra = kv_transfer_config["kv_connector_extra_config"]
            geo = H.Geometry(worker_kv_bytes_per_block=1 << 16, gpu_block_size=16, block_size=64, num_rows=96)
            self.he = H.HeadlessEngine(extra["secondary_tiers"], geo)
            he = self.he
            self.ttft_block_bytes = (
                he.row_bytes
            )  # ttft.py's expected bytes per block (the 32b shape's 16 MiB otherwise)
            self.mp = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
            self.core_lock = threading.RLock()
            self._stop = threading.Event()
            if self.mp:

                def core_loop():
                    while not self._stop.is_set():
                        with self.core_lock:
                            if he.has_pending_work():
                                he.step()
                        time.sleep(0.002)

                threading.Thread(target=core_loop, daemon=True, name="fake-engine-core").start()
            sched = NS(
                connector=NS(
                    connector_scheduler=NS(manager=he.manager), has_pending_push_work=lambda: he.has_pending_work()
                )
            )
            self.llm_engine = NS(
                engine_core=NS(engine_core=NS(scheduler=sched)),
                vllm_config=NS(
                    scheduler_config=NS(max_num_batched_tokens=16384),
                    cache_config=NS(num_gpu_blocks=1000),
                    instance_id=he.engine_id,
                ),
                step=lambda: (he.step(), time.sleep(0.002)),
            )
            if self.mp:  # the engine core is out of reach in this layout: only shutdown() is called
                self.llm_engine.engine_core = NS(shutdown=self._stop.set)
            self.gpu = set()

        def generate(self, prompts, sp, use_tqdm=False):
            with self.core_lock:
                return self._generate(prompts, sp)

        def _generate(self, prompts, sp):
            ids = prompts[0]["prompt_token_ids"]
            n_full = len(ids) // 64
            keys = [H.make_key(hashlib.sha256(repr(ids[: 64 * (i + 1)]).encode()).digest()) for i in range(n_full)]
            maxhit = n_full  # vLLM 0.25 loads every full block of a revisited prompt (512 of a 32k prompt on the H200)
            tag = tuple(ids)
            cached = 0
            if tag not in self.gpu and maxhit:
                req = self.he.new_request()
                tr = self.he.lookup_until_resolved(keys[:maxhit], req)
                if tr.resolved and all(r is LookupResult.HIT for r in tr.final):
                    with self.he.lock:
                        self.he.manager.prepare_load(keys[:maxhit], req)
                        self.he.manager.complete_load(keys[:maxhit], req)
                    cached = maxhit * 64
                self.he.store_chunks(req, [k for k in keys if not self.he.in_primary(k)])
                self.he.finish_request(req)
                self.he.step()
            self.gpu.add(tag)
            comp = NS(token_ids=[sum(ids) % 997], logprobs=[{sum(ids) % 997: NS(logprob=-1.0), 3: NS(logprob=-2.0)}])
            return [NS(outputs=[comp], num_cached_tokens=cached)]

        def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            with self.core_lock:
                self.gpu.clear()
                if reset_connector:
                    self.he.reset_cache()
                return True

        def get_metrics(self):
            return []

    vllm.LLM = FakeLLM

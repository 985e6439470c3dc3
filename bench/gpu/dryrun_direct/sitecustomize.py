"""Dry run of bench/gpu/direct.py without a GPU: with this folder first on PYTHONPATH and
TTFT_FAKE_LLM=1, `vllm.LLM` becomes a stand-in. Direct mode runs on the conformance suite's
tests/conformance/direct_harness.py (vLLM's real OffloadingConnector, scheduler and worker
side, CPU tensors, real `memkv serve` nodes); tier mode on bench/gpu/dryrun's stand-in. No
model: outputs are a hash of the prompt. It checks the script's flow (modes, roles, reset,
settle, counters, JSON, table) before spending device time; its timings mean nothing.

    TTFT_FAKE_LLM=1 PYTHONPATH=bench/gpu/dryrun_direct:src:. .nox/conformance-0-25-0/bin/python \\
      bench/gpu/direct.py --shape toy --tokens 1024,2048 --staging-mb 64 --cpu-gib 0.1 \\
      --node-capacity 1GiB --out-dir /tmp/direct-dry
"""

import os

if os.environ.get("TTFT_FAKE_LLM"):
    import hashlib
    import runpy
    import sys
    from types import SimpleNamespace as NS

    here = os.path.dirname(os.path.abspath(__file__))
    repo = os.path.abspath(os.path.join(here, "..", "..", ".."))
    runpy.run_path(os.path.join(here, "..", "dryrun", "sitecustomize.py"))  # installs the tier stand-in
    sys.path.insert(0, repo)
    import vllm

    TierLLM = vllm.LLM

    class DirectLLM:
        def __init__(self, model, kv_transfer_config, **kw):
            from tests.conformance import direct_harness as dh

            extra = dict(kv_transfer_config["kv_connector_extra_config"])
            extra["block_size"] = 64
            self.dh = dh
            self.engine = dh.DirectEngine(dh.Geometry(block_size=64, num_gpu_blocks=4096), extra, token_budget=4096)
            engine = self.engine
            import atexit

            atexit.register(engine.shutdown)  # vLLM shuts its connector down; the bench's child just exits
            sched = NS(
                connector=NS(
                    connector_scheduler=engine.connector.connector_scheduler,
                    has_pending_push_work=engine.connector.has_pending_push_work,
                )
            )
            self.llm_engine = NS(engine_core=NS(engine_core=NS(scheduler=sched)), step=engine.step)

        def generate(self, prompts, sp, use_tqdm=False):
            ids = prompts[0]["prompt_token_ids"]
            tag = hashlib.sha256(repr(ids).encode()).hexdigest()
            self.engine.run(tag, len(ids), timeout_s=120)
            tok = sum(ids) % 997
            comp = NS(token_ids=[tok], logprobs=[{tok: NS(logprob=-1.0), 3: NS(logprob=-2.0)}])
            return [NS(outputs=[comp])]

        def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            if reset_connector:
                self.engine.connector.reset_cache()
            return True

    class PlainLLM:
        """No offload connector (direct.py's mode "none"): every run a prefill."""

        def __init__(self, model, kv_transfer_config, **kw):
            self.llm_engine = NS(engine_core=NS(engine_core=NS(scheduler=NS(connector=None))), step=lambda: None)

        def generate(self, prompts, sp, use_tqdm=False):
            ids = prompts[0]["prompt_token_ids"]
            tok = sum(ids) % 997
            comp = NS(token_ids=[tok], logprobs=[{tok: NS(logprob=-1.0), 3: NS(logprob=-2.0)}])
            return [NS(outputs=[comp])]

        def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
            return True

    def LLM(model, kv_transfer_config, **kw):
        if kv_transfer_config is None:
            return PlainLLM(model, kv_transfer_config, **kw)
        spec = kv_transfer_config["kv_connector_extra_config"]["spec_name"]
        return (DirectLLM if spec == "MemKVOffloadingSpec" else TierLLM)(model, kv_transfer_config, **kw)

    vllm.LLM = LLM

"""A stand-in for `vllm serve` in serve.py's dry run (no GPU): the OpenAI completions endpoint
(streamed as server-sent events, chunked like uvicorn), /health and /metrics, in front of the
fake engine of sitecustomize.py (TTFT_FAKE_LLM=1: vLLM's real TieringOffloadingManager, the
real memkv tier, real nodes; no model). It takes `vllm serve`'s arguments and uses --port,
--kv-transfer-config, --served-model-name; the memkv plugin is loaded through the
`vllm.general_plugins` entry point (as vLLM does), so serve.py's dist-info is exercised too.
Its timings mean nothing; see bench/gpu/stage.md.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

assert os.environ.get("TTFT_FAKE_LLM"), "needs TTFT_FAKE_LLM=1 and bench/gpu/dryrun first on PYTHONPATH"


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("model")
    ap.add_argument("--port", type=int, required=True)
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--kv-transfer-config", required=True)
    ap.add_argument("--served-model-name", default=None)
    args, _rest = ap.parse_known_args()
    from importlib.metadata import entry_points

    loaded = []
    for ep in entry_points(group="vllm.general_plugins"):
        ep.load()()
        loaded.append(ep.name)
    print(f"stand-in: plugins loaded through entry points: {loaded}", flush=True)
    import vllm

    llm = vllm.LLM(model=args.model, kv_transfer_config=json.loads(args.kv_transfer_config))
    tiers = llm.he.manager.secondary_tiers
    name = args.served_model_name or args.model

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *a):
            pass

        def _send(self, code, ctype, body: bytes):
            self.send_response(code)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self):
            if self.path == "/health":
                self._send(200, "application/json", b"")
            elif self.path == "/metrics":
                lines = []
                for tier in tiers:
                    with tier.stats._lock:
                        totals = dict(tier.stats.totals)
                    for (n, labels), v in sorted(totals.items()):
                        lab = (
                            f',result="{labels[0]}"'
                            if labels and "lookups" in n
                            else (f',op="{labels[0]}"' if labels else "")
                        )
                        lines.append(f'{n}_total{{engine="0",model_name="{name}"{lab}}} {float(v)}')
                self._send(200, "text/plain; version=0.0.4", ("\n".join(lines) + "\n").encode())
            else:
                self._send(404, "application/json", b'{"error": "not found"}')

        def do_POST(self):
            n = int(self.headers.get("Content-Length", 0))
            req = json.loads(self.rfile.read(n))
            if self.path != "/v1/completions" or not isinstance(req.get("prompt"), list):
                self._send(400, "application/json", b'{"error": "stand-in: /v1/completions with token ids only"}')
                return
            out = llm.generate([{"prompt_token_ids": req["prompt"]}], None)[0]
            comp = out.outputs[0]
            tok = comp.token_ids[0]
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()

            def event(obj):
                data = f"data: {obj if isinstance(obj, str) else json.dumps(obj)}\n\n".encode()
                self.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
                self.wfile.flush()

            choice = {"index": 0, "text": "", "token_ids": [tok], "finish_reason": "length"}
            if req.get("logprobs"):
                choice["logprobs"] = {
                    "tokens": [f"token_id:{tok}"],
                    "token_logprobs": [-1.0],
                    "top_logprobs": [{f"token_id:{k}": v.logprob for k, v in comp.logprobs[0].items()}],
                }
            event(
                {
                    "id": "cmpl-standin",
                    "object": "text_completion",
                    "created": int(time.time()),
                    "model": name,
                    "choices": [choice],
                }
            )
            event(
                {
                    "id": "cmpl-standin",
                    "object": "text_completion",
                    "model": name,
                    "choices": [],
                    "usage": {
                        "prompt_tokens": len(req["prompt"]),
                        "completion_tokens": 1,
                        "total_tokens": len(req["prompt"]) + 1,
                        "prompt_tokens_details": {"cached_tokens": out.num_cached_tokens},
                    },
                }
            )
            event("[DONE]")
            self.wfile.write(b"0\r\n\r\n")
            self.wfile.flush()

    httpd = ThreadingHTTPServer((args.host, args.port), Handler)
    httpd.daemon_threads = True

    def stop(signum, frame):
        print(f"stand-in: signal {signum}, shutting down", flush=True)
        threading.Thread(target=httpd.shutdown, daemon=True).start()

    signal.signal(signal.SIGINT, stop)
    signal.signal(signal.SIGTERM, stop)
    print(f"stand-in: serving on {args.host}:{args.port}", flush=True)
    httpd.serve_forever(poll_interval=0.2)
    llm.he.shutdown()
    print("stand-in: stopped", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Serve the HTTP API from your own nursery, next to your other tasks.

    MLXD_MODEL=/path/to/model python docs/examples/embed_http.py
"""

import os

import httpx
import trio

import mlxd
from mlxd.http.app import serve_http


async def main():
    config = mlxd.RuntimeConfig(model=os.environ.get("MLXD_MODEL"), model_name="my-model")
    stop = trio.Event()
    async with mlxd.open_runtime(config) as rt, trio.open_nursery() as nursery:
        # port=0 picks a free port; serve_http reports the bound addresses once it listens.
        binds = await nursery.start(
            lambda task_status: serve_http(rt, host="127.0.0.1", port=0, shutdown_trigger=stop.wait,
                                           task_status=task_status)
        )
        base = binds[0]
        print("listening on", base)

        def client_calls():  # any HTTP client works; this one runs on a worker thread
            body = {"model": "my-model", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 8}
            reply = httpx.post(f"{base}/v1/chat/completions", json=body, timeout=60).json()
            print("usage:", reply["usage"])
            metrics = httpx.get(f"{base}/metrics", timeout=10).text
            print([line for line in metrics.splitlines() if line.startswith("mlxd_requests_submitted_total")])

        await trio.to_thread.run_sync(client_calls)
        stop.set()  # hypercorn finishes in-flight requests, then serve_http returns
    print("stopped")


if __name__ == "__main__":
    trio.run(main)

"""Run mlxd inside your own trio program: start, stream, inspect, flush, stop.

    MLXD_MODEL=/path/to/model python docs/examples/embed_nursery.py

Without MLXD_MODEL the built-in random-weight model is built on first use.
"""

import os
import tempfile

import trio

import mlxd
from mlxd.runtime.logging import configure_logging
from mlxd.runtime.chat.text import TextAssembler


async def main():
    ssd_dir = tempfile.mkdtemp(prefix="mlxd-ssd-")
    config = mlxd.RuntimeConfig(model=os.environ.get("MLXD_MODEL"), ssd_cache_dir=ssd_dir, snapshot_min_tokens=16)

    async with trio.open_nursery() as nursery:  # your program's nursery
        # serve_runtime reports the Runtime once every actor is up, then runs until cancelled.
        rt = await nursery.start(mlxd.serve_runtime, config)
        print("model:", rt.info.model_name)

        # Stream tokens of one chat turn, detokenizing as they arrive.
        prompt = await rt.render_chat([{"role": "user", "content": "Say something about caches."}])
        request = rt.request(prompt, sampling=mlxd.SamplingParams(max_tokens=12))
        text = TextAssembler(rt.tokenizer, eos_ids=rt.info.eos_token_ids)
        async with rt.submit(request) as stream:
            async for event in stream:
                if isinstance(event, mlxd.PromptAccepted):
                    print(f"prompt: {event.prompt_tokens} tokens, {event.cached_tokens} cached ({event.cache_tier})")
                elif isinstance(event, mlxd.TokenGenerated):
                    print(repr(text.add(event.token)), end=" ", flush=True)
        print(repr(text.finish()))
        print("finished:", stream.finished.reason, stream.finished.completion_tokens, "tokens")

        # Every actor channel is a bounded trio memory channel; statistics() shows its load.
        print("durability inbox:", rt.cold.durability_inbox.statistics())
        stats = await rt.stats()
        for name, channel in stats.channels.items():
            print(f"channel {name}: {channel.queued} queued of {channel.capacity}")

        # Make every RAM checkpoint durable on SSD (what POST /admin/cache/flush does).
        report = await rt.flush()
        print("flush:", report)
        assert report["durable"]

        nursery.cancel_scope.cancel()  # shut down: cancel the scope that owns the runtime
    print("stopped")


if __name__ == "__main__":
    configure_logging("auto")  # structlog to stderr: JSON lines, or pretty on a terminal
    trio.run(main)

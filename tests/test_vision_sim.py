"""`mlxd simulate` replays a vision server's recording: image spans are blocks of the trace like any tokens."""

from __future__ import annotations

import base64
import io
import json
import sys
from pathlib import Path

import numpy as np
import trio
from PIL import Image

from mlxd import SamplingParams, open_runtime
from mlxd.cli import record_trace
from mlxd.sim.trace import load_recording
from mlxd.vision.images import ImageLimits
from mlxd.vision.prepare import MediaPreparer, image_refs

from serving import config_for


def png(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def chat(image: str, text: str) -> list[dict]:
    return [{"role": "system", "content": "You look at pictures and say what you see. " * 3},
            {"role": "user", "content": [{"type": "image_url", "image_url": {"url": image}},
                                         {"type": "text", "text": text}]}]


async def test_a_recording_with_images_replays_with_the_same_hits(tmp_path: Path, vlm_model_dir: Path) -> None:
    model = vlm_model_dir
    preparer = MediaPreparer.for_model(model, limits=ImageLimits(), ssd_dir=None)
    assert preparer is not None
    trace = tmp_path / "live.jsonl"
    # the same image again (a hit through it), another image in the same place (a hit up to it)
    conversations = [chat(png(1), "What is it?"), chat(png(1), "And now?"), chat(png(2), "What is it?")]
    async with open_runtime(config_for(model)) as rt:
        record_trace(rt, trace)
        for messages in conversations:
            images = await trio.to_thread.run_sync(preparer.prepare, image_refs(messages))
            prompt, media = preparer.widen(await rt.render_chat(messages, realign=False), images)
            async with rt.submit(rt.request(prompt, sampling=SamplingParams(max_tokens=4), media=media)) as stream:
                await stream.tokens()
            # The replay places requests at their recorded times and prices them with a default cost
            # model (no device probe here): leave it time to finish each before the next arrives.
            await trio.sleep(0.5)
    recording = load_recording(trace)
    live = [r.cached_tokens for r in recording.reqs]
    assert live[0] == 0 and live[1] > 0 and 0 < live[2] < live[1]
    out = await trio.run_process(
        [sys.executable, "-m", "mlxd.cli", "simulate", str(trace), "--cache-model", "mlxd", "--format", "json"],
        capture_stdout=True, capture_stderr=True,
    )
    (sim,) = [json.loads(line) for line in out.stdout.decode().splitlines() if line.startswith("{")]
    assert sim["input_tokens"] == sum(r.input_length for r in recording.reqs)
    assert sim["ram_hit_tokens"] == sum(live)

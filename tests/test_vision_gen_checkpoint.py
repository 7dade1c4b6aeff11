"""A generation with an image in its prompt checkpoints in flight and resumes like a text one (seed §5.7)."""

from __future__ import annotations

import base64
import io
from pathlib import Path

import numpy as np
import trio
from PIL import Image

from mlxd import SamplingParams, open_runtime
from mlxd.vision.images import ImageLimits
from mlxd.vision.prepare import MediaPreparer, image_refs

from serving import config_for, drop_after

NO_EOS = ((0, -100.0), (2, -100.0))  # the test tokenizer's EOS ids never win: generations run to max_tokens


def png(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


async def test_a_dropped_image_generation_resumes_from_its_checkpoint(tmp_path: Path, vlm_model_dir: Path) -> None:
    preparer = MediaPreparer.for_model(vlm_model_dir, limits=ImageLimits(), ssd_dir=None)
    assert preparer is not None
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png(4)}},
                                             {"type": "text", "text": "Describe it at length."}]}]
    config = config_for(vlm_model_dir, ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=16)
    sampling = SamplingParams(max_tokens=60, logit_bias=NO_EOS)
    async with open_runtime(config) as rt:
        ckpt = rt.cold.checkpointer

        async def settle() -> None:
            with trio.fail_after(60):
                while ckpt.snapshot_stats()["pending"] or ckpt.snapshot_stats()["owned"]:  # noqa: ASYNC110
                    await trio.sleep(0.02)
                await trio.sleep(0.05)

        images = await trio.to_thread.run_sync(preparer.prepare, image_refs(messages))
        prompt, media = preparer.widen(await rt.render_chat(messages, realign=False), images)
        async with rt.submit(rt.request(prompt, sampling=sampling, media=media)) as stream:
            full = await stream.tokens()
        assert len(full) == 60
        await settle()
        seen = await drop_after(rt, rt.request(prompt, sampling=sampling, media=media), 40)  # the client goes away
        await settle()
        assert seen == full[:40] and len(list(ckpt.directory.glob("*.mlxgen"))) == 1
        async with rt.submit(rt.request(prompt, sampling=sampling, media=media)) as stream:
            again = await stream.tokens()
            assert stream.accepted.cache_tier == "checkpoint"
            assert stream.accepted.cached_tokens == len(prompt)
        assert again == full and ckpt.stats["resumed"] == 1

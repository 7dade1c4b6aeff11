"""Images under --speculative: image rows draft (n-grams, or a draft model reading the placeholders).

A row whose prompt holds images decodes with token ids only once its media
prefill is done, so its drafts are verified like a text row's, in the same
forward as the batch's text rows (the test-vlm language model has plain 1-D
positions: the verify forward's K+1 positions are the cache offset onward, as
K+1 single steps would be). Checked on the real test-vlm model: a mixed batch
of image and text rows, greedy and seeded, equal token for token (logprobs to
1e-4) to speculation off, with n-grams and with a draft model; the draft's end
checkpoint holds every token the target's does; and chat completions with an
image over HTTP (once a 400) equal to speculation off.
"""

from __future__ import annotations

import base64
import io
import random
from pathlib import Path

import httpx
import numpy as np
import pytest
import trio
from PIL import Image

from mlxd import SamplingParams, open_runtime
from mlxd.engine.core import EngineCore
from mlxd.engine.drive import run_rows
from mlxd.engine.speculative import draft_namespace
from mlxd.runtime.kernel.messages import (
    GenerationRequest,
)
from mlxd.vision.images import ImageLimits
from mlxd.vision.prepare import MediaPreparer, image_refs

from serving import ServerThread, checkpoints_settled, config_for, drop_after

NO_EOS = ((0, -100.0), (2, -100.0))  # the test tokenizer's end tokens never win: rows run to max_tokens
rnd = random.Random(2323)


def png_url(seed: int) -> str:
    buf = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)).save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def cores(vlm_model_dir: Path):
    """Speculation off, n-grams, and a draft model (the target's own language model: it reads an image
    span as its placeholder tokens, so its drafts there are often wrong and rejected)."""
    made = {
        "off": EngineCore(config_for(vlm_model_dir)),
        "ngram": EngineCore(config_for(vlm_model_dir, speculative="ngram", num_draft_tokens=4)),
        "draft": EngineCore(config_for(vlm_model_dir, speculative="draft", draft_model=str(vlm_model_dir))),
    }
    tags = {name: core.load().draft_tag for name, core in made.items()}
    yield made, tags["draft"]
    for core in made.values():
        core.close()


@pytest.fixture(scope="module")
def preparer(vlm_model_dir: Path) -> MediaPreparer:
    p = MediaPreparer.for_model(vlm_model_dir, limits=ImageLimits(), ssd_dir=None)
    assert p is not None
    return p


def _image_request(preparer: MediaPreparer, rid: str, image: int, **sampling: object) -> GenerationRequest:
    text = [rnd.randrange(3, 250) for _ in range(20)]
    ids = [*text[:8], preparer.placeholder, *text[8:], *text[8:]]  # text repeated after the image: n-grams find it
    prompt, media = preparer.widen(ids, preparer.prepare([(png_url(image), "auto", "test")]))
    return GenerationRequest(request_id=rid, prompt=prompt, media=media,
                             sampling=SamplingParams(logit_bias=NO_EOS, **sampling))  # type: ignore[arg-type]


def _text_request(rid: str, **sampling: object) -> GenerationRequest:
    prompt = tuple(rnd.randrange(3, 250) for _ in range(30))
    return GenerationRequest(request_id=rid, prompt=prompt * 2,
                             sampling=SamplingParams(logit_bias=NO_EOS, **sampling))  # type: ignore[arg-type]


def _drive(core: EngineCore, reqs: list[GenerationRequest]):
    """Run rows to their end: tokens and logprobs per request, and every checkpoint published."""
    run = run_rows(core, reqs)
    return run.tokens, run.logprobs, run.notes


def test_image_rows_speculate_in_a_mixed_batch_with_output_identical_to_off(cores, preparer) -> None:
    made, tag = cores
    reqs = [
        _image_request(preparer, "img-greedy", 1, max_tokens=40, logprobs=True),
        _image_request(preparer, "img-seeded", 2, max_tokens=36, temperature=0.8, seed=11, logprobs=True),
        _image_request(preparer, "img-hot", 3, max_tokens=30, temperature=1.4, top_p=0.9, seed=5),
        _text_request("text-greedy", max_tokens=40, logprobs=True),
        _text_request("text-seeded", max_tokens=33, temperature=0.9, seed=7, logprobs=True),
    ]
    plain, plain_lp, _ = _drive(made["off"], reqs)
    assert made["off"].stats().media_prefills == 3
    for name in ("ngram", "draft"):
        core = made[name]
        got, got_lp, notes = _drive(core, reqs)
        assert got == plain, name
        for rid, lps in plain_lp.items():
            if lps[0] is not None:
                assert got_lp[rid] == pytest.approx(lps, abs=1e-4), (name, rid)
        spec = core.stats().speculation
        assert spec is not None and spec.active and spec.proposed > 0 and spec.accepted > 0, (name, spec)
        assert core.stats().media_prefills == 3, "every image row ran its media prefill"

        if name == "draft":
            # The draft's end-of-row checkpoint holds every token the target's does (no gap after its
            # last proposal), image rows included (their media ids are the key, placeholders its input).
            ns = draft_namespace("", tag)
            finals = [n for n in notes if n.reason == "final"]
            targets = {n.tokens for n in finals if n.namespace == ""}
            drafts = {n.tokens for n in finals if n.namespace == ns}
            assert len(targets) == len(reqs) and drafts == targets


def test_image_rows_alone_speculate_greedy_and_seeded(cores, preparer) -> None:
    """Image rows only (one and two in a batch): the n-gram part drafts from the text after the image."""
    made, _ = cores
    before = made["ngram"].stats().speculation
    assert before is not None
    for reqs in (
        [_image_request(preparer, "one", 4, max_tokens=48)],
        [_image_request(preparer, "a", 5, max_tokens=40, temperature=0.7, seed=3),
         _image_request(preparer, "b", 5, max_tokens=44)],  # the same image twice: one encoder output
    ):
        plain = _drive(made["off"], reqs)[0]
        assert _drive(made["ngram"], reqs)[0] == plain
    after = made["ngram"].stats().speculation
    assert after is not None and after.verify_steps > before.verify_steps and after.accepted > before.accepted


@pytest.mark.parametrize("mode", ["ngram", "draft"])
def test_images_over_http_with_speculation_equal_speculation_off(vlm_model_dir: Path, mode: str) -> None:
    """A chat with an image under --speculative is served (it was a 400), with the tokens and logprobs of off."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(9)}},
                                             {"type": "text", "text": "Describe it, then describe it again."}]}]
    body = {"messages": messages, "max_tokens": 40, "logprobs": True, "logit_bias": {"0": -100, "2": -100}}
    replies = {}
    extra = {"speculative": "draft", "draft_model": str(vlm_model_dir)} if mode == "draft" else {"speculative": mode}
    for name, cfg in (("off", {}), ("on", extra)):
        with ServerThread(config_for(vlm_model_dir, **cfg)) as server:
            for sampling in ({"temperature": 0}, {"temperature": 0.9, "seed": 21}):
                r = httpx.post(f"{server.base_url}/chat/completions", json={**body, **sampling}, timeout=120)
                assert r.status_code == 200, r.text
                choice = r.json()["choices"][0]
                replies[name, sampling["temperature"]] = (
                    choice["message"]["content"], [t["token"] for t in choice["logprobs"]["content"]],
                    [t["logprob"] for t in choice["logprobs"]["content"]],
                )
            if name == "on":
                stats = httpx.get(server.base_url.removesuffix("/v1") + "/stats", timeout=30).json()["engine"]
                assert stats["speculation"]["active"] and stats["speculation"]["proposed"] > 0
                assert stats["media_prefills"] >= 1
    for temperature in (0, 0.9):
        off, on = replies["off", temperature], replies["on", temperature]
        assert on[:2] == off[:2]
        assert on[2] == pytest.approx(off[2], abs=1e-4)


@pytest.mark.parametrize("mode", ["ngram", "draft"])
async def test_a_dropped_image_generation_resumes_identically_under_speculation(
    tmp_path: Path, vlm_model_dir: Path, preparer: MediaPreparer, mode: str
) -> None:
    """Images + speculation + generation checkpoints: a dropped seeded image row resumes from its
    checkpoint with the uninterrupted tokens; with a draft model its draft takes its prefix (the
    image span's media ids are its key too) from the cache instead of recomputing it."""
    messages = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(4)}},
                                             {"type": "text", "text": "Describe it at length, twice."}]}]
    sampling = SamplingParams(max_tokens=60, temperature=0.9, seed=8, logit_bias=NO_EOS)
    async with open_runtime(config_for(vlm_model_dir)) as rt:
        images = await trio.to_thread.run_sync(preparer.prepare, image_refs(messages))
        prompt, media = preparer.widen(await rt.render_chat(messages, realign=False), images)
        async with rt.submit(rt.request(prompt, sampling=sampling, media=media)) as stream:
            reference = await stream.tokens()
    extra = {"speculative": "draft", "draft_model": str(vlm_model_dir)} if mode == "draft" else {"speculative": mode}
    config = config_for(vlm_model_dir, ssd_cache_dir=tmp_path / "ssd", generation_checkpoint=16, **extra)
    async with open_runtime(config) as rt:
        seen = await drop_after(rt, rt.request(prompt, sampling=sampling, media=media), 40)  # the client goes away
        assert seen == reference[:40]
        ckpt = rt.cold.checkpointer
        await checkpoints_settled(rt)
        await trio.sleep(0.05)
        before = (await rt.stats()).engine.speculation
        async with rt.submit(rt.request(prompt, sampling=sampling, media=media)) as stream:
            again = await stream.tokens()
            assert stream.accepted.cache_tier == "checkpoint"
        assert again == reference and ckpt.stats["resumed"] == 1
        after = (await rt.stats()).engine.speculation
        assert before is not None and after is not None and after.proposed > 0
        if mode == "draft":
            reused = after.draft_prefix_reused - before.draft_prefix_reused
            recomputed = after.draft_prefix_recomputed - before.draft_prefix_recomputed
            assert reused > len(prompt) and recomputed <= 2, (reused, recomputed)

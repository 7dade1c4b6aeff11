"""--adapter NAME=DIR: mlx-lm LoRA adapters chosen per request by `model`, batched with the base.

Two random adapters for the tiny test model are written as `mlx_lm.lora` writes
trained ones (mlx-lm's own tuner converts the layers; mlxd.model.lora). Each
row must give what `mlx_lm.load(model, adapter_path=DIR)` gives alone (greedy
tokens, logprobs), in a batch mixing adapters and the base; and each adapter is
its own cache namespace, in RAM and on SSD across a restart.
"""

from __future__ import annotations

import json
import random
import threading
from pathlib import Path

import httpx
import mlx.core as mx
import pytest
from mlx_lm.utils import load

from mlxd.cli import build_parser, main
from mlxd.engine import adapters as adapters_mod
from mlxd.engine.core import EngineCore
from mlxd.engine.loading import cast_float_weights
from mlxd.engine.ops import ModelRefused, RowStart, StepOps
from mlxd.model.lora import build_adapter
from mlxd.runtime.config import RuntimeConfig
from mlxd.runtime.kernel.messages import (
    GenerationFinished,
    GenerationRequest,
    SamplingParams,
    TokenGenerated,
)

from serving import ServerThread, config_for
from ssd_files import checkpoint_files

rnd = random.Random(25)


def prompt(n: int = 40) -> tuple[int, ...]:
    return tuple(rnd.randrange(3, 250) for _ in range(n))


@pytest.fixture(scope="module")
def lora_dirs(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """"one": every linear of every layer, rank 4; "two": q and v of the last layer only, rank 8."""
    root = tmp_path_factory.mktemp("adapters")
    return {
        "one": build_adapter(tiny_model_dir, root / "one", seed=1, rank=4),
        "two": build_adapter(tiny_model_dir, root / "two", seed=2, rank=8, num_layers=1,
                             keys=["self_attn.q_proj", "self_attn.v_proj"]),
    }


@pytest.fixture(scope="module")
def reference(tiny_model_dir: Path):
    """name -> (prompt, n) -> (greedy tokens, their logprobs) from mlx-lm alone, the adapter loaded its way."""
    from mlx_lm.generate import generate_step

    models: dict[str | None, object] = {}

    def run(adapter: Path | None, ids: tuple[int, ...], n: int) -> tuple[list[int], list[float]]:
        if adapter not in models:
            model, _ = load(str(tiny_model_dir), adapter_path=str(adapter) if adapter else None)
            cast_float_weights(model, mx.float32)  # as the server does on CPU
            models[adapter] = model
        tokens, logprobs = [], []
        for (token, lp), _ in zip(generate_step(mx.array(ids), models[adapter], max_tokens=n), range(n), strict=False):
            tokens.append(int(token))
            logprobs.append(float(lp[int(token)]))
        return tokens, logprobs

    return run


def adapter_config(tiny_model_dir: Path, lora_dirs: dict[str, Path], **overrides: object) -> RuntimeConfig:
    pairs = tuple((name, str(path)) for name, path in lora_dirs.items())
    return config_for(tiny_model_dir, adapters=pairs, **overrides)


# --- the engine core: one batch mixing the base and both adapters ------------------------------


def test_a_mixed_batch_matches_mlx_lm_row_for_row(tiny_model_dir, lora_dirs, reference):
    """Base, "one" and "two" rows decode together (one joins mid-decode); each equals mlx-lm alone."""
    for speculative in ("off", "ngram", "draft"):  # the verifying batch selects adapters too
        # A draft model (here the base model itself) proposes without adapters; the adapted target verifies.
        draft = {"draft_model": str(tiny_model_dir)} if speculative == "draft" else {}
        core = EngineCore(adapter_config(tiny_model_dir, lora_dirs, prompt_cache_bytes=0, speculative=speculative,
                                         **draft))
        info = core.load()
        ns = {a.name: a.namespace for a in info.adapters}
        assert set(ns) == {"one", "two"} and len(set(ns.values())) == 2 and "" not in ns.values()
        p = {"base": prompt(), "one": prompt(), "two": prompt(), "one-late": prompt(30)}
        names = {"base": "", "one": ns["one"], "two": ns["two"], "one-late": ns["one"]}
        requests = {rid: GenerationRequest(request_id=rid, prompt=p[rid], namespace=names[rid],
                                           sampling=SamplingParams(max_tokens=12, logprobs=True)) for rid in p}
        tokens: dict[str, list[int]] = {rid: [] for rid in p}
        logprobs: dict[str, list[float]] = {rid: [] for rid in p}
        done: set[str] = set()
        ops = StepOps(starts=tuple(RowStart(request=requests[r]) for r in ("base", "one", "two")))
        steps = 0
        while len(done) < len(p):
            result = core.step(ops)
            steps += 1
            ops = StepOps(starts=(RowStart(request=requests["one-late"]),)) if steps == 4 else StepOps()
            assert not result.rejected, result.rejected
            for emit in result.emits:
                if isinstance(emit.event, TokenGenerated):
                    tokens[emit.request_id].append(emit.event.token)
                    logprobs[emit.request_id].append(emit.event.logprob)
                elif isinstance(emit.event, GenerationFinished):
                    done.add(emit.request_id)
        spec = core.stats().speculation
        assert speculative == "off" or (spec is not None and spec.accepted > 0), "drafts were verified"
        core.close()
        for rid in p:
            adapter = lora_dirs.get(rid.removesuffix("-late"))
            want_tokens, want_logprobs = reference(adapter, p[rid], len(tokens[rid]))
            assert tokens[rid] == want_tokens, (speculative, rid)
            assert logprobs[rid] == pytest.approx(want_logprobs, abs=1e-4), (speculative, rid)
    # The adapters change the model: the base model's logprobs for "one"'s prompt differ.
    base_tokens, base_logprobs = reference(None, p["one"], 12)
    one_tokens, one_logprobs = reference(lora_dirs["one"], p["one"], 12)
    assert base_logprobs != pytest.approx(one_logprobs, abs=1e-2)


def test_quantized_kv_rows_in_a_mixed_batch_match_each_row_alone(tmp_path_factory):
    """--kv-bits 8 (test-wide: head_dim 64): a base row and an adapter row batched give what each gives alone."""
    from mlxd.model import build_model

    root = tmp_path_factory.mktemp("wide")
    model_dir = build_model(root / "model", "test-wide", seed=0)
    pairs = (("one", str(build_adapter(model_dir, root / "one", seed=1))),)
    ids = {"base": prompt(), "one": prompt()}

    def run(rows: tuple[str, ...]) -> dict[str, list[tuple[int, float]]]:
        core = EngineCore(config_for(model_dir, adapters=pairs, prompt_cache_bytes=0, kv_bits=8))
        ns = {a.name: a.namespace for a in core.load().adapters}
        starts = tuple(RowStart(request=GenerationRequest(
            request_id=r, prompt=ids[r], namespace=ns.get(r, ""),
            sampling=SamplingParams(max_tokens=10, logprobs=True))) for r in rows)
        out: dict[str, list[tuple[int, float]]] = {r: [] for r in rows}
        done: set[str] = set()
        ops = StepOps(starts=starts)
        while len(done) < len(rows):
            result, ops = core.step(ops), StepOps()
            for emit in result.emits:
                if isinstance(emit.event, TokenGenerated):
                    out[emit.request_id].append((emit.event.token, emit.event.logprob))
                elif isinstance(emit.event, GenerationFinished):
                    done.add(emit.request_id)
        core.close()
        return out

    both = run(("base", "one"))
    for rid in ("base", "one"):
        alone = run((rid,))[rid]
        assert [t for t, _ in both[rid]] == [t for t, _ in alone], rid
        assert [lp for _, lp in both[rid]] == pytest.approx([lp for _, lp in alone], abs=1e-4), rid
    assert both["one"] != both["base"]


# --- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_model_dir, lora_dirs):
    with ServerThread(adapter_config(tiny_model_dir, lora_dirs)) as s:
        yield s


def complete(server, model: str, ids: tuple[int, ...], max_tokens: int = 8) -> dict:
    r = httpx.post(server.base_url + "/completions", timeout=120, json={
        "model": model, "prompt": list(ids), "max_tokens": max_tokens, "logprobs": 0, "temperature": 0})
    assert r.status_code == 200, r.text
    return r.json()


def check_against(reference, tokenizer, body: dict, adapter: Path | None, ids: tuple[int, ...]) -> None:
    got = body["choices"][0]["logprobs"]
    want_tokens, want_logprobs = reference(adapter, ids, len(got["tokens"]))
    assert got["tokens"] == [tokenizer.decode([t]) for t in want_tokens]
    assert got["token_logprobs"] == pytest.approx(want_logprobs, abs=1e-4)


def test_each_model_name_serves_its_adapter(server, lora_dirs, reference):
    tokenizer = server.runtime.tokenizer
    for model in ("tiny", "default", "one", "two"):
        ids = prompt()
        body = complete(server, model, ids)
        check_against(reference, tokenizer, body, lora_dirs.get(model), ids)
        assert body["model"] == (model if model in lora_dirs else "tiny")


def test_concurrent_requests_of_each_adapter_match_mlx_lm(server, lora_dirs, reference):
    tokenizer = server.runtime.tokenizer
    jobs = [(model, prompt(36 + 4 * i)) for i, model in enumerate(("tiny", "one", "two", "one", "tiny", "two"))]
    bodies: list[dict | None] = [None] * len(jobs)

    def send(i: int) -> None:
        bodies[i] = complete(server, jobs[i][0], jobs[i][1], max_tokens=16)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(jobs))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for (model, ids), body in zip(jobs, bodies, strict=True):
        assert body is not None
        check_against(reference, tokenizer, body, lora_dirs.get(model), ids)


def cached(body: dict) -> int:
    return body["usage"]["prompt_tokens_details"]["cached_tokens"]


def test_no_prefix_is_shared_across_adapters_or_with_the_base(server):
    ids = prompt(48)
    assert cached(complete(server, "one", ids)) == 0
    assert cached(complete(server, "one", ids)) > 0, "the same adapter reuses its own prefix"
    assert cached(complete(server, "two", ids)) == 0, "another adapter never does"
    assert cached(complete(server, "tiny", ids)) == 0, "nor does the base model"
    assert cached(complete(server, "default", ids)) > 0, "the base reuses its own (under its alias too)"
    chat = {"messages": [{"role": "user", "content": "Adapters keep their own caches. " * 4}], "max_tokens": 2}
    for model, want in (("one", 0), ("one", 1), ("two", 0)):
        r = httpx.post(server.base_url + "/chat/completions", json={"model": model, **chat}, timeout=60)
        assert r.status_code == 200, r.text
        assert (cached(r.json()) > 0) == bool(want), (model, r.json()["usage"])


def test_a_session_and_kv_event_blocks_stay_within_their_adapter(server):
    """The session index keys on (namespace, session): one prompt_cache_key under two adapters is two
    sessions; KV-event block hashes are chained over the namespace, so no block is announced as shared."""
    from mlxd.kv.kv_events import block_hashes

    ids = prompt(40)

    def send(model: str) -> int:
        r = httpx.post(server.base_url + "/completions", timeout=60, json={
            "model": model, "prompt": list(ids), "max_tokens": 2, "prompt_cache_key": "agent-7"})
        assert r.status_code == 200, r.text
        return cached(r.json())

    assert send("one") == 0
    assert send("two") == 0, "the same session under another adapter starts from nothing"
    assert send("one") > 0 and send("two") > 0, "each adapter's session has its own latest checkpoint"
    namespaces = {a.name: a.namespace for a in server.runtime.info.adapters}
    blocks = [set(block_hashes(ids, ns, block_size=16)) for ns in ("", namespaces["one"], namespaces["two"])]
    assert all(blocks) and not (blocks[0] & blocks[1]) and not (blocks[1] & blocks[2]) and not (blocks[0] & blocks[2])


def test_models_lists_the_adapters_and_unknown_names_are_404(server):
    listed = httpx.get(server.base_url + "/models", timeout=30).json()["data"]
    assert [(m["id"], m.get("parent")) for m in listed] == [("tiny", None), ("one", "tiny"), ("two", "tiny")]
    assert httpx.get(server.base_url + "/models/two", timeout=30).json()["parent"] == "tiny"
    for route, body in (("/completions", {"prompt": "hi"}),
                        ("/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
                        ("/messages", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
                        ("/responses", {"input": "hi"})):
        r = httpx.post(server.base_url + route, json={"model": "three", **body}, timeout=30)
        assert r.status_code == 404, (route, r.text)
        assert "'three'" in r.text and "'one'" in r.text, r.text


def test_the_other_routes_select_the_adapter_too(server):
    """Messages and Responses run the chat route's path: the adapter's namespace, its own cache."""
    for route, body, usage in (
        ("/messages", {"messages": [{"role": "user", "content": "Messages keep the adapter's own. " * 4}],
                       "max_tokens": 2},
         lambda u: u["cache_read_input_tokens"]),
        ("/responses", {"input": "Responses keep the adapter's own. " * 4, "max_output_tokens": 2},
         lambda u: u["input_tokens_details"]["cached_tokens"]),
    ):
        reads = []
        for model in ("two", "two", "one"):
            r = httpx.post(server.base_url + route, json={"model": model, **body}, timeout=60)
            assert r.status_code == 200, r.text
            assert r.json()["model"] == model, "the reply names the adapter, as the chat route's does"
            reads.append(usage(r.json()["usage"]))
        # (the template's first few tokens may hit: earlier requests of the same adapter opened that way)
        assert reads[1] > 40 and reads[0] < 10 and reads[2] < 10, (route, reads)


def test_the_ssd_tier_keeps_namespaces_apart_across_a_restart(tiny_model_dir, lora_dirs, tmp_path):
    ids = prompt(48)
    config = adapter_config(tiny_model_dir, lora_dirs, ssd_cache_dir=tmp_path / "ssd")
    with ServerThread(config) as first:
        for model in ("one", "tiny"):
            assert cached(complete(first, model, ids)) == 0
        r = httpx.post(first.base_url.removesuffix("/v1") + "/admin/cache/flush", timeout=60)
        assert r.status_code == 200 and r.json()["durable"], r.text
    namespaces = {p.parent.name for p in checkpoint_files(tmp_path / "ssd")}  # manifests or whole files
    assert len(namespaces) == 2, "one directory per namespace: the base's and one's"
    with ServerThread(config) as second:
        assert cached(complete(second, "two", ids)) == 0, "two never reads one's or the base's files"
        one = complete(second, "one", ids)
        assert cached(one) > 0, "one restores its own"
        assert cached(complete(second, "tiny", ids)) > 0, "the base restores its own"


def test_image_requests_under_an_adapter(vlm_model_dir, tmp_path_factory):
    """A vision model's adapter: the image prefix is prefilled with the adapter (its own namespace, no hit
    across), the encoder's output is shared (the tower is not adapted), and a batch equals each row alone."""
    import base64
    import io
    from concurrent.futures import ThreadPoolExecutor

    import numpy as np
    from PIL import Image

    def user(text: str, seed: int) -> dict:
        pixels = np.random.default_rng(seed).integers(0, 256, (56, 84, 3), dtype=np.uint8)
        buf = io.BytesIO()
        Image.fromarray(pixels).save(buf, format="PNG")
        url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
        return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                            {"type": "text", "text": text}]}

    lora = build_adapter(vlm_model_dir, tmp_path_factory.mktemp("vlm-lora") / "v", seed=3)
    with ServerThread(config_for(vlm_model_dir, adapters=(("v", str(lora)),))) as s:
        def ask(model: str, seed: int, n: int = 6) -> dict:
            r = httpx.post(s.base_url + "/chat/completions", timeout=120, json={
                "model": model, "messages": [user("What is in the picture?", seed)], "max_tokens": n,
                "temperature": 0, "logprobs": True})
            assert r.status_code == 200, r.text
            return r.json()

        def logprobs(body: dict) -> list[float]:
            return [e["logprob"] for e in body["choices"][0]["logprobs"]["content"]]

        first = ask("v", 1)
        assert cached(first) == 0 and cached(ask("v", 1)) > 0, "the adapter reuses its own image prefix"
        base = ask("tiny", 1)
        assert cached(base) == 0, "the base never reads the adapter's"
        assert logprobs(base) != pytest.approx(logprobs(first), abs=1e-3), "the adapter changes the output"
        with ThreadPoolExecutor(2) as pool:  # cold, at once: both images prefilled, one decoding batch
            together = list(pool.map(lambda m: ask(m, 2), ("v", "tiny")))
        alone = [ask(m, 2) for m in ("v", "tiny")]  # now RAM hits of what the batch published
        for a, b in zip(together, alone, strict=True):
            assert a["choices"][0]["message"]["content"] == b["choices"][0]["message"]["content"]
            assert logprobs(a) == pytest.approx(logprobs(b), abs=1e-4)


# --- refusals --------------------------------------------------------------------------------


def _rewrite(src: Path, dest: Path, *, config=None, weights=None) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "adapter_config.json").read_text())
    (dest / "adapter_config.json").write_text(json.dumps(config(cfg) if config else cfg))
    w = dict(mx.load(str(src / "adapters.safetensors")))
    mx.save_safetensors(str(dest / "adapters.safetensors"), weights(w) if weights else w)
    return dest


def _first_a(w: dict) -> dict:
    key = sorted(k for k in w if k.endswith("lora_a"))[0]
    return {**w, key: mx.zeros((w[key].shape[0] + 8, w[key].shape[1]))}


@pytest.mark.parametrize(("case", "message"), [
    ("missing", "no adapter_config.json there"),
    ("dora", "DoRA adapters are not supported"),
    ("full", "serve it with --model"),
    ("unknown", "unknown fine_tune_type 'prefix'"),
    ("alpha", "use 'scale'"),
    ("shape", "does not fit this model"),
    ("stranger", "not a LoRA parameter of this model"),
    ("clash", "the served model's own"),
    ("alias", "the served model's own"),
    ("twice", "is given twice"),
])
def test_adapters_that_cannot_serve_are_refused_at_load(tiny_model_dir, lora_dirs, tmp_path, case, message):
    one = lora_dirs["one"]
    made = {
        "missing": lambda: (tmp_path / "empty").mkdir() or tmp_path / "empty",
        "dora": lambda: _rewrite(one, tmp_path / "d", config=lambda c: {**c, "fine_tune_type": "dora"}),
        "full": lambda: _rewrite(one, tmp_path / "d", config=lambda c: {**c, "fine_tune_type": "full"}),
        "unknown": lambda: _rewrite(one, tmp_path / "d", config=lambda c: {**c, "fine_tune_type": "prefix"}),
        "alpha": lambda: _rewrite(one, tmp_path / "d", config=lambda c: {
            **c, "lora_parameters": {"rank": 4, "alpha": 8}}),
        "shape": lambda: _rewrite(one, tmp_path / "d", weights=_first_a),
        "stranger": lambda: _rewrite(one, tmp_path / "d", weights=lambda w: {**w, "model.norm.lora_a": mx.zeros((2,))}),
    }
    path = made[case]() if case in made else one
    pairs = {"clash": [("tiny", str(one))], "alias": [("default", str(one))],
             "twice": [("x", str(one)), ("x", str(lora_dirs["two"]))]}.get(case, [("x", str(path))])
    model, _ = load(str(tiny_model_dir))
    with pytest.raises(ModelRefused, match=message):
        adapters_mod.install(model, pairs, reserved=("tiny", "default", "default_model"))
    assert not any(isinstance(m, adapters_mod.RowLoRA) for _, m in model.named_modules()), "left untouched"


def test_a_refused_adapter_stops_the_server_with_its_reason(tiny_model_dir, tmp_path):
    config = config_for(tiny_model_dir, adapters=(("x", str(tmp_path / "nowhere")),))
    with pytest.raises(BaseException) as failed:
        with ServerThread(config):
            pass
    assert failed.group_contains(ModelRefused) if isinstance(failed.value, BaseExceptionGroup) else isinstance(
        failed.value, ModelRefused), repr(failed.value)


def test_flags():
    parser = build_parser()
    args = parser.parse_args(["serve", "--adapter", "a=/x", "--adapter", "b = /y"])
    assert args.adapter == [("a", "/x"), ("b", "/y")]
    for bad in ("nodir", "=/x", "a b=/x", "a="):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", "--adapter", bad])
    with pytest.raises(ValueError, match="--adapter is not supported with --distributed"):
        RuntimeConfig(distributed=True, adapters=(("a", "/x"),))


def test_build_adapter_writes_one_mlxd_serves(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "cli"
    assert main(["build-adapter", "--model", str(tiny_model_dir), "--out", str(out), "--rank", "2",
                 "--keys", "mlp.down_proj"]) == 0
    assert capsys.readouterr().out.strip() == str(out)
    model, _ = load(str(tiny_model_dir))
    (info,) = adapters_mod.install(model, [("cli", str(out))], reserved=("tiny",)).infos
    assert (info.rank, info.modules) == (2, 2), "mlp.down_proj of both blocks"

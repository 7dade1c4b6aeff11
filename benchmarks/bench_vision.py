"""What do media prefix identity and the encoder-output cache buy a vision conversation?

One real `mlxd serve` on a random-weight vision preset (`bench-vlm` by default:
the "default" decoder and a 6-block x 256 Qwen2-VL-shaped tower), over HTTP.
Latency is a `max_tokens=1` request's wall time (prefill + one token: the TTFT).
Per round, fresh images (so nothing carries over between rounds):

- turn 2 / turn 1: an image turn, then its text follow-up (the image's KV is reused);
- N-image follow-up / text follow-up: a conversation of N turns with one image
  each, then one more text turn, against the same conversation with each image
  replaced by as many text tokens (goal <= 1.1x: images cost nothing once cached);
- encoder hit / re-encode: the same image in a new conversation (the KV misses,
  the encoder output is lent from RAM) against a new image of the same size;
- with `--route responses` (or `both`, the default) the N-image ÷ text follow-up again
  through /v1/responses: turn 1 sends the N images (stored), the follow-up only its new
  text with `previous_response_id`, so no client re-sends the images.

    python benchmarks/bench_vision.py [--preset bench-vlm] [--images 10] [--rounds 3] [--side 448] [--route both]

Results go to benchmarks/results/vision-*.json.
"""

from __future__ import annotations

import argparse
import base64
import io
import json
import platform
import statistics
import struct
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve_proc import ServeProc  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
SETTLE_S = 0.5  # idle time before each measured follow-up
LAST = "Which of these pictures was the brightest, and why do you think so?"  # the measured follow-up's question


def png(seed: int, side: int) -> str:
    rng = np.random.default_rng(seed)
    pixels = rng.integers(0, 256, (side, side, 3), dtype=np.uint8)
    try:
        from PIL import Image
    except ImportError:  # a host without Pillow (the client only): the same pixels, written by hand
        return "data:image/png;base64," + base64.b64encode(_png_bytes(pixels)).decode()
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


def _png_bytes(pixels: np.ndarray) -> bytes:
    """An 8-bit RGB PNG of `pixels` (h, w, 3), no filter."""
    h, w, _ = pixels.shape

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + pixels[y].tobytes() for y in range(h))
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows, 6)) + chunk(b"IEND", b""))


def image_turn(url: str, text: str) -> dict[str, Any]:
    return {"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": text}]}


def responses_body(input: Any, *, previous: str | None = None, max_tokens: int = 1) -> dict[str, Any]:
    body: dict[str, Any] = {"input": input, "max_output_tokens": max_tokens, "temperature": 0, "store": True}
    if previous is not None:
        body["previous_response_id"] = previous
    return body


def body_bytes(body: Any) -> int:
    """The request body's size as the clients here send it."""
    return len(json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode())


class Client:
    """httpx as an OpenAI client sends (the body JSON-encoded per request, inside the timing);
    without httpx (the GPU host), http.client on one kept-alive connection, encoding the same way."""

    def __init__(self, proc: ServeProc) -> None:
        self.proc = proc
        try:
            import httpx
        except ImportError:
            self.http: Any = None
            self.conn = _StdlibHttp(proc.url)
        else:
            self.http = httpx.Client(base_url=proc.url, timeout=600)

    def ask(self, messages: list[dict[str, Any]], max_tokens: int = 1) -> tuple[float, dict[str, Any]]:
        return self.post("/v1/chat/completions", {"messages": messages, "max_tokens": max_tokens, "temperature": 0})

    def respond(self, input: Any, *, previous: str | None = None, max_tokens: int = 1) -> tuple[float, dict[str, Any]]:
        """POST /v1/responses (stored), continuing `previous` when given."""
        return self.post("/v1/responses", responses_body(input, previous=previous, max_tokens=max_tokens))

    def post(self, path: str, body: dict[str, Any]) -> tuple[float, dict[str, Any]]:
        t0 = time.perf_counter()
        if self.http is None:
            reply = self.conn.post_json(path, body)
            return time.perf_counter() - t0, reply
        r = self.http.post(path, json=body)
        seconds = time.perf_counter() - t0
        if r.status_code >= 400:
            raise RuntimeError(f"POST {path}: HTTP {r.status_code}: {r.text[:500]}")
        return seconds, r.json()

    def get(self, path: str) -> dict[str, Any]:
        return self.conn.get_json(path) if self.http is None else self.http.get(path).json()

    def engine_ttft(self) -> float:
        """The server's own TTFT of the last request (its request.done log line), in seconds."""
        done = [line for line in self.proc.log().splitlines() if '"request.done"' in line]
        return json.loads(done[-1])["ttft_ms"] / 1000

    def engine(self) -> dict[str, Any]:
        return self.get("/stats")["engine"]


class _StdlibHttp:
    def __init__(self, url: str) -> None:
        import http.client
        import urllib.parse

        u = urllib.parse.urlsplit(url)
        self.conn = http.client.HTTPConnection(u.hostname, u.port, timeout=600)

    def _json(self, method: str, path: str, body: bytes | None) -> dict[str, Any]:
        headers = {"Content-Type": "application/json"} if body is not None else {}
        self.conn.request(method, path, body=body, headers=headers)
        r = self.conn.getresponse()
        data = r.read()
        if r.status >= 400:
            raise RuntimeError(f"{method} {path}: HTTP {r.status}: {data[:500]!r}")
        return json.loads(data)

    def post_json(self, path: str, body: Any) -> dict[str, Any]:
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()  # as httpx
        return self._json("POST", path, raw)

    def post_staged(self, path: str, body: Any) -> dict[str, float]:
        """POST `body` as httpx would, with a perf_counter stamp after each client step."""
        at = {"client_start": time.perf_counter()}
        raw = json.dumps(body, ensure_ascii=False, separators=(",", ":"), allow_nan=False).encode()
        at["client_encoded"] = time.perf_counter()
        self.conn.request("POST", path, body=raw, headers={"Content-Type": "application/json"})
        at["client_sent"] = time.perf_counter()
        r = self.conn.getresponse()
        at["client_headers"] = time.perf_counter()
        data = r.read()
        at["client_read"] = time.perf_counter()
        if r.status >= 400:
            raise RuntimeError(f"POST {path}: HTTP {r.status}: {data[:500]!r}")
        json.loads(data)
        at["client_decoded"] = time.perf_counter()
        return at

    def get_json(self, path: str) -> dict[str, Any]:
        return self._json("GET", path, None)


# One follow-up's timeline, client and server (http/stages.py) on the host's one monotonic clock:
# (stage, the stamp it ends at), each from the stamp before it.
STAGES = (
    ("client: JSON-encode the body", "client_encoded"),
    ("to the server's handler (headers)", "arrived"),
    ("server: receive the body", "body_complete"),
    ("server: wake with the body", "body"),
    ("server: lift known data: URLs", "lifted"),
    ("server: JSON parse", "parsed"),
    ("server: check messages", "checked"),
    ("server: images (known()/prepare)", "images"),
    ("server: render + tokenize", "rendered"),
    ("server: media key (widen)", "keyed"),
    ("server: submit", "submitted"),
    ("engine: prefill to first token", "first_token"),
    ("server: finish the reply", "replied"),
    ("server: encode the response", "response"),
    ("to the client (response headers)", "client_headers"),
    ("client: read the response", "client_read"),
    ("client: JSON-decode it", "client_decoded"),
)


def staged(proc: ServeProc, messages: list[dict[str, Any]], conn: _StdlibHttp | None = None) -> dict[str, float]:
    """One max_tokens=1 request on `conn` (kept alive), else a fresh stdlib connection: each stage's ms
    (STAGES), and its wall."""
    fresh = conn is None
    if conn is None:
        conn = _StdlibHttp(proc.url)
        conn.get_json("/health")  # connected before the clock starts
    at = conn.post_staged("/v1/chat/completions", {"messages": messages, "max_tokens": 1, "temperature": 0})
    if fresh:
        conn.conn.close()
    lines = [line for line in proc.log().splitlines() if '"request.stages"' in line]
    server = json.loads(lines[-1])["stamps"]
    at.update(server)
    out, prev = {}, at["client_start"]
    for name, stamp in STAGES:
        if stamp in at:
            out[name] = (at[stamp] - prev) * 1000
            prev = at[stamp]
    out["client: send (conn.request, beside the above)"] = (at["client_sent"] - at["client_encoded"]) * 1000
    out["wall"] = (at["client_decoded"] - at["client_start"]) * 1000
    # The sums that answer "where does the extra go", per request (then the median):
    out["= client start to submit"] = (at["submitted"] - at["client_start"]) * 1000
    out["= outside the engine (wall - prefill to first token)"] = out["wall"] - out["engine: prefill to first token"]
    return out


def stage_breakdown(proc: ServeProc, client: Client, *, images: int, side: int, span: int, pairs: int,
                    keep_alive: bool) -> dict[str, Any]:
    """Where an N-image follow-up's wall time goes against a text follow-up's: medians over `pairs`."""
    system = "Stages: you are a careful assistant who looks at pictures."
    with_images = conversation(
        client, [image_turn(png(777_000 + i, side), f"Picture {i}?") for i in range(images)], system)
    text_only = conversation(client, [{"role": "user", "content": f"{' a' * span} Picture {i}?"} for i in range(images)],
                             system + " ")
    runs: dict[str, list[dict[str, float]]] = {"images": [], "text": []}
    conn = _StdlibHttp(proc.url) if keep_alive else None  # one connection for all, as bench clients keep
    if conn is not None:
        conn.get_json("/health")
    for k in range(pairs):
        last = {"role": "user", "content": f"Which of these pictures was the brightest ({k})?"}
        order = ("images", "text") if k % 2 == 0 else ("text", "images")
        for kind in order:
            time.sleep(SETTLE_S)
            runs[kind].append(staged(proc, [*(with_images if kind == "images" else text_only), last], conn))
    med = {kind: {name: statistics.median(r[name] for r in rs) for name in rs[0]} for kind, rs in runs.items()}
    how = "one kept-alive connection" if keep_alive else "a fresh connection each"
    print(f"stage breakdown, {images}-image vs text follow-up (stdlib client, {how}; ms, median of {pairs}):")
    print(f"  {'':52s} {'images':>9s} {'text':>9s} {'extra':>9s}")
    for name in med["images"]:
        a, b = med["images"][name], med["text"][name]
        print(f"  {name:52s} {a:9.2f} {b:9.2f} {a - b:+9.2f}")
    return {"pairs": pairs, "keep_alive": keep_alive, "medians": med, "runs": runs}


def conversation(client: Client, turns: list[dict[str, Any]], system: str) -> list[dict[str, Any]]:
    """Play `turns` (user messages) one by one with real replies, as a chat UI would."""
    messages = [{"role": "system", "content": system}]
    for turn in turns:
        messages.append(turn)
        _, body = client.ask(messages, max_tokens=6)
        messages.append({"role": "assistant", "content": body["choices"][0]["message"]["content"]})
    return messages


def followup_pairs(client: Client, r: int, pairs: int, send: Any) -> dict[str, Any]:
    """`pairs` measured follow-ups of each kind ("images", "text"), alternating which goes first:
    `send(kind, text)` -> (seconds, body); per kind the runs [wall, server TTFT] and the last body."""
    out: dict[str, Any] = {"images": {"runs": []}, "text": {"runs": []}}
    for k in range(pairs):
        text = (f"({k}) " if k else "") + LAST  # a new question each pair, new from its start (prefilled whole)
        for kind in (("images", "text") if (r + k) % 2 == 0 else ("text", "images")):
            # The previous reply's trailing work (its checkpoint) must not land on this one's TTFT.
            time.sleep(SETTLE_S)
            seconds, body = send(kind, text)
            out[kind]["runs"].append([seconds, client.engine_ttft()])
            out[kind]["body"] = body
    return out


def arm_figures(prefix: str, measured: dict[str, Any], usage: Any) -> dict[str, Any]:
    """A round's figures of one arm: medians over its pairs, the runs, prompt and cached tokens."""
    out: dict[str, Any] = {}
    for kind, m in measured.items():
        prompt, cached = usage(m["body"])
        out.update({f"{prefix}{kind}_followup_s": statistics.median(w for w, _ in m["runs"]),
                    f"{prefix}{kind}_followup_server_s": statistics.median(s for _, s in m["runs"]),
                    f"{prefix}{kind}_followup_runs": m["runs"], f"{prefix}{kind}_prompt": prompt,
                    f"{prefix}{kind}_cached": cached})
    return out


def chat_arm(client: Client, r: int, *, images: int, side: int, span: int, seed: int, pairs: int) -> dict[str, Any]:
    """An N-image conversation's follow-up against a text-only one of the same length (chat: every
    request re-sends the whole conversation, its images included)."""
    filler = " a" * span  # one token per " a" in the test tokenizers; lengths are reported
    system = f"Round {r}: you are a careful assistant who looks at pictures."
    history = {
        "images": conversation(
            client, [image_turn(png(seed + 1 + i, side), f"Picture {i}?") for i in range(images)], system),
        "text": conversation(client, [{"role": "user", "content": f"{filler} Picture {i}?"} for i in range(images)],
                             system + " "),
    }
    measured = followup_pairs(client, r, pairs, lambda kind, text: client.ask(
        [*history[kind], {"role": "user", "content": text}]))
    return arm_figures("", measured, lambda b: (b["usage"]["prompt_tokens"],
                                                b["usage"]["prompt_tokens_details"]["cached_tokens"]))


def responses_arm(client: Client, r: int, *, images: int, side: int, span: int, seed: int, pairs: int) -> dict[str, Any]:
    """The N-image ÷ text follow-up through /v1/responses: turn 1 holds the N images (the text twin:
    as many filler tokens each), each follow-up sends its new text only, with previous_response_id."""
    system = {"role": "system", "content": f"Round {r}: you are a careful assistant who looks at pictures (responses)."}
    with_images: list[dict[str, Any]] = []
    for i in range(images):
        with_images += [{"type": "input_image", "image_url": png(seed + 500 + i, side)},
                        {"type": "input_text", "text": f"Picture {i}?"}]
    text = "".join(f"{' a' * span} Picture {i}?" for i in range(images))
    firsts = {"images": [system, {"role": "user", "content": with_images}],
              "text": [{**system, "content": system["content"] + " "}, {"role": "user", "content": text}]}
    turn1 = {kind: client.respond(first, max_tokens=6)[1] for kind, first in firsts.items()}  # real replies, stored
    before = client.get("/stats").get("media", {})
    measured = followup_pairs(client, r, pairs, lambda kind, text: client.respond(text, previous=turn1[kind]["id"]))
    after = client.get("/stats").get("media", {})
    out = arm_figures("responses_", measured, lambda b: (b["usage"]["input_tokens"],
                                                         b["usage"]["input_tokens_details"]["cached_tokens"]))
    for kind in firsts:
        out.update({f"responses_{kind}_turn1_prompt": turn1[kind]["usage"]["input_tokens"],
                    f"responses_{kind}_turn1_body_bytes": body_bytes(responses_body(firsts[kind], max_tokens=6)),
                    f"responses_{kind}_followup_body_bytes": body_bytes(
                        responses_body(LAST, previous=turn1[kind]["id"]))})
    out["responses_followups_decoded"] = after.get("images_decoded", 0) - before.get("images_decoded", 0)
    return out


def one_round(client: Client, r: int, *, images: int, side: int, span: int, route: str, pairs: int) -> dict[str, Any]:
    seed = 1000 * (r + 1)
    out: dict[str, Any] = {}
    # Turn 1 (cold: encode + prefill) and its follow-up.
    first = [{"role": "system", "content": f"Round {r}."}, image_turn(png(seed, side), "What is in this picture?")]
    t1, b1 = client.ask(first)
    s1 = client.engine_ttft()
    follow = [*first, {"role": "assistant", "content": b1["choices"][0]["message"]["content"]},
              {"role": "user", "content": "And what colour is it mostly?"}]
    t2, b2 = client.ask(follow)
    s2 = client.engine_ttft()
    out.update(turn1_s=t1, turn2_s=t2, turn1_server_s=s1, turn2_server_s=s2, turn1_prompt=b1["usage"]["prompt_tokens"],
               turn2_cached=b2["usage"]["prompt_tokens_details"]["cached_tokens"])
    if route in ("chat", "both"):
        out.update(chat_arm(client, r, images=images, side=side, span=span, seed=seed, pairs=pairs))
    if route in ("responses", "both"):
        out.update(responses_arm(client, r, images=images, side=side, span=span, seed=seed, pairs=pairs))
    # The encoder cache: the same image in a new conversation vs a new image (both miss the KV).
    before = client.engine()
    th, _ = client.ask([{"role": "system", "content": f"Elsewhere {r}."}, image_turn(png(seed, side), "Again?")])
    mid = client.engine()
    tm, _ = client.ask([{"role": "system", "content": f"Elsewhere {r}!"}, image_turn(png(seed + 999, side), "Again?")])
    after = client.engine()
    out.update(encoder_hit_s=th, reencode_s=tm,
               encoder_hit_ram_hits=mid["media_encoder_ram_hits"] - before["media_encoder_ram_hits"],
               reencode_encoded=after["media_encoded"] - mid["media_encoded"])
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", default="bench-vlm")
    p.add_argument("--model", help="a vision model directory (instead of --preset)")
    p.add_argument("--images", type=int, default=10)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--side", type=int, default=448, help="image side in pixels (448: 256 tokens on bench-vlm)")
    p.add_argument("--label", default=platform.node())
    p.add_argument("--stage-pairs", type=int, default=8, help="image/text follow-up pairs timed stage by stage (0: none)")
    p.add_argument("--stage-connection", choices=("keep", "fresh"), default="keep",
                   help="the stage pairs on one kept-alive connection (as the rounds' client), or a fresh one each")
    p.add_argument("--route", choices=("chat", "responses", "both"), default="both",
                   help="the N-image / text follow-up on /v1/chat/completions (re-sends the images), on "
                        "/v1/responses (previous_response_id: new text only), or both side by side")
    p.add_argument("--pairs", type=int, default=1,
                   help="measured image/text follow-up pairs per round and route (a round's figure: their median)")
    args = p.parse_args()
    model = ["--model", args.model] if args.model else ["--preset", args.preset]
    with tempfile.TemporaryDirectory() as tmp, ServeProc([*model, "--device-probe", "off", "--log-level", "debug"],
                                                                       Path(tmp) / "serve.log") as proc:
        client = Client(proc)
        _, warm = client.ask([image_turn(png(1, args.side), "warm up")])  # imports, first kernels
        span = warm["usage"]["prompt_tokens"] - client.ask([{"role": "user", "content": "warm up"}])[1]["usage"]["prompt_tokens"] - 2
        rounds = [one_round(client, r, images=args.images, side=args.side, span=span, route=args.route,
                            pairs=args.pairs) for r in range(args.rounds)]
        stages = (stage_breakdown(proc, client, images=args.images, side=args.side, span=span, pairs=args.stage_pairs,
                                  keep_alive=args.stage_connection == "keep")
                  if args.stage_pairs > 0 and args.route != "responses" else None)
    med = {k: statistics.median(x[k] for x in rounds) for k, v in rounds[0].items() if not isinstance(v, list)}
    n = args.images

    def ratio(a: str, b: str) -> float:
        return statistics.median(x[a] / x[b] for x in rounds)

    def paired(pre: str, at: int) -> float:
        """The median over every pair of its image / text ratio (at 0: wall, 1: server TTFT)."""
        return statistics.median(i[at] / t[at] for x in rounds
                                 for i, t in zip(x[f"{pre}images_followup_runs"], x[f"{pre}text_followup_runs"], strict=True))

    ratios = {"turn2 / turn1": ratio("turn2_s", "turn1_s"), "encoder hit / re-encode": ratio("encoder_hit_s", "reencode_s")}
    if "images_followup_s" in med:
        ratios[f"{n}-image follow-up / text follow-up"] = ratio("images_followup_s", "text_followup_s")
        ratios[f"{n}-image / text follow-up, server TTFT"] = ratio("images_followup_server_s", "text_followup_server_s")
        if args.pairs > 1:
            ratios[f"{n}-image / text follow-up, per pair"] = paired("", 0)
            ratios[f"{n}-image / text follow-up, server TTFT, per pair"] = paired("", 1)
    if "responses_images_followup_s" in med:
        ratios[f"responses: {n}-image / text follow-up"] = ratio("responses_images_followup_s", "responses_text_followup_s")
        ratios[f"responses: {n}-image / text follow-up, server TTFT"] = ratio(
            "responses_images_followup_server_s", "responses_text_followup_server_s")
        if args.pairs > 1:
            ratios[f"responses: {n}-image / text follow-up, per pair"] = paired("responses_", 0)
            ratios[f"responses: {n}-image / text follow-up, server TTFT, per pair"] = paired("responses_", 1)
    print(f"image span {span} tokens ({args.side}x{args.side} px); {args.rounds} rounds; medians:")
    print(f"  turn 1 {med['turn1_s'] * 1000:8.1f} ms   turn 2 {med['turn2_s'] * 1000:8.1f} ms"
          f"   (cached {med['turn2_cached']:.0f} of {med['turn1_prompt']:.0f}+)")
    if "images_followup_s" in med:
        print(f"  chat: {n}-image follow-up {med['images_followup_s'] * 1000:8.1f} ms ({med['images_prompt']:.0f} tokens, "
              f"{med['images_cached']:.0f} cached)   text follow-up {med['text_followup_s'] * 1000:8.1f} ms "
              f"({med['text_prompt']:.0f} tokens, {med['text_cached']:.0f} cached); server TTFT "
              f"{med['images_followup_server_s'] * 1000:.1f} / {med['text_followup_server_s'] * 1000:.1f} ms")
    if "responses_images_followup_s" in med:
        for kind, name in (("images", f"{n}-image"), ("text", "text")):
            k = f"responses_{kind}"
            print(f"  responses: {name} follow-up {med[k + '_followup_s'] * 1000:8.1f} ms, server TTFT "
                  f"{med[k + '_followup_server_s'] * 1000:.1f} ms ({med[k + '_prompt']:.0f} tokens, "
                  f"{med[k + '_cached']:.0f} cached; turn 1 {med[k + '_turn1_prompt']:.0f}); body "
                  f"{med[k + '_followup_body_bytes']:.0f} B (turn 1 {med[k + '_turn1_body_bytes']:.0f} B)")
        short = [x["responses_images_cached"] - x["responses_images_turn1_prompt"] for x in rounds]
        print(f"  responses: the follow-up's cached tokens - turn 1's prompt, per round: {short} (>= -1: covered); "
              f"images decoded during the follow-ups: {sum(x['responses_followups_decoded'] for x in rounds)}")
    # What the request costs outside the engine (wall - server TTFT, per request, then the median over all
    # of them): on a device whose follow-up prefill is ~15 ms, this is what decides the wall ratio.
    outside = {f"{route} {kind}": statistics.median((w - e) * 1000 for x in rounds
                                                    for w, e in x[f"{pre}{kind}_followup_runs"])
               for route, pre in (("chat", ""), ("responses", "responses_")) if f"{pre}images_followup_s" in med
               for kind in ("images", "text")}
    print("  outside the engine (wall - server TTFT, ms): "
          + ", ".join(f"{name} follow-up {ms:.1f}" for name, ms in outside.items()))
    print(f"  encoder hit {med['encoder_hit_s'] * 1000:8.1f} ms   re-encode {med['reencode_s'] * 1000:8.1f} ms")
    print(f"  server-side TTFT (request.done): turn 1 {med['turn1_server_s'] * 1000:.1f} ms, turn 2 "
          f"{med['turn2_server_s'] * 1000:.1f} ms")
    for name, value in ratios.items():
        print(f"  {name:62s} {value:6.3f}x")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"vision-{time.strftime('%Y%m%d-%H%M%S')}.json"
    out.write_text(json.dumps({"label": args.label, "args": vars(args), "span": span, "rounds": rounds,
                               "medians": med, "ratios": ratios, "outside_engine_ms": outside,
                               "stages": stages}, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

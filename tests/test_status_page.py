"""The `/` status page in headless Chromium: a real render of live /stats."""

from __future__ import annotations

import os
import re
import shutil
import struct
import subprocess
import zlib
from pathlib import Path

import httpx
import numpy as np
import pytest

from serving import ServerThread, config_for

MESSAGES = [{"role": "system", "content": "Keep the status page busy. " * 12}, {"role": "user", "content": "Go."}]
WIDTH, HEIGHT = 1200, 900


def find_chromium() -> str:
    """Debian's chromium; installed here when missing and we may (root with apt-get)."""
    for name in ("chromium", "chromium-browser"):
        if path := shutil.which(name):
            return path
    if os.geteuid() != 0 or shutil.which("apt-get") is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium) and we are not root to install it")
    env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
    install = ["apt-get", "install", "-y", "-q", "chromium"]
    if subprocess.run(install, env=env, capture_output=True, timeout=900).returncode != 0:
        subprocess.run(["apt-get", "update", "-q"], env=env, capture_output=True, timeout=600)
        subprocess.run(install, env=env, capture_output=True, timeout=900)
    path = shutil.which("chromium")
    if path is None:
        pytest.skip("could not install chromium with apt-get")
    return path


def chromium(binary: str, profile: Path, *action: str, url: str) -> subprocess.CompletedProcess:
    args = [
        binary, "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
        "--disable-background-networking", "--disable-component-update", "--disable-sync",
        f"--user-data-dir={profile}", f"--window-size={WIDTH},{HEIGHT}", "--virtual-time-budget=3000",
        *action, url,
    ]
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def png_pixels(data: bytes) -> np.ndarray:
    """The (height, width, channels) uint8 pixels of an 8-bit non-interlaced RGB/RGBA PNG."""
    assert data[:8] == b"\x89PNG\r\n\x1a\n"
    pos, chunks, header = 8, [], b""
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = body
        elif kind == b"IDAT":
            chunks.append(body)
        pos += 12 + length
    width, height, depth, color = struct.unpack(">IIBB", header[:10])
    assert depth == 8 and color in (2, 6), "expected 8-bit RGB or RGBA"
    bpp = 3 if color == 2 else 4
    raw = np.frombuffer(zlib.decompress(b"".join(chunks)), np.uint8).reshape(height, width * bpp + 1)
    out = np.zeros((height, width * bpp), np.uint8)
    prev = np.zeros(width * bpp, np.uint8)
    for y in range(height):
        out[y] = prev = _unfilter(int(raw[y, 0]), raw[y, 1:], prev, bpp)
    return out.reshape(height, width, bpp)


def _unfilter(kind: int, line: np.ndarray, prev: np.ndarray, bpp: int) -> np.ndarray:
    if kind == 0:
        return line.copy()
    if kind == 1:  # Sub: a running sum per channel, mod 256
        return (np.cumsum(line.reshape(-1, bpp), axis=0, dtype=np.uint64) & 255).astype(np.uint8).ravel()
    if kind == 2:  # Up
        return line + prev
    cur, up = bytearray(line.tobytes()), prev.tobytes()
    for i in range(len(cur)):
        a, b, c = cur[i - bpp] if i >= bpp else 0, up[i], up[i - bpp] if i >= bpp else 0
        if kind == 3:  # Average
            cur[i] = (cur[i] + (a + b) // 2) & 255
        else:  # Paeth
            p = a + b - c
            pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
            cur[i] = (cur[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
    return np.frombuffer(bytes(cur), np.uint8)


@pytest.fixture(scope="module")
def live(tiny_model_dir, tmp_path_factory):
    ssd = tmp_path_factory.mktemp("ssd")
    with ServerThread(config_for(tiny_model_dir, ssd_cache_dir=ssd)) as server:
        body = {"model": "tiny", "messages": MESSAGES, "temperature": 0, "max_tokens": 4}
        for _ in range(2):  # a miss, then a RAM hit
            r = httpx.post(f"{server.base_url}/chat/completions", json=body, timeout=120)
            assert r.status_code == 200
        yield server, server.base_url.removesuffix("/v1") + "/"


def test_page_is_static_html_without_external_urls(live):
    _, url = live
    r = httpx.get(url, timeout=30)
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/html")
    assert "/stats" in r.text or '"stats"' in r.text
    assert not re.search(r"""(src|href)=["']?(https?:)?//""", r.text), "no external resources"


def test_dom_shows_live_stats(live, tmp_path):
    server, url = live
    binary = find_chromium()
    done = chromium(binary, tmp_path / "profile", "--dump-dom", url=url)
    assert done.returncode == 0, done.stderr[-2000:]
    field = {m[0]: m[1] for m in re.findall(r'id="([a-z-]+)">([^<]*)<', done.stdout)}
    stats = httpx.get(url + "stats", timeout=30).json()
    assert field["model"] == "tiny"
    assert field["state"] == "serving"
    assert field["submitted"] == str(stats["scheduler"]["submitted"]) == "2"
    assert field["completed"] == "2"
    assert field["max-queue"] == str(server.config.max_queue)
    assert field["max-batch"] == str(server.config.max_batch)
    assert field["ram-hits"] == "1 / 1"
    assert field["ram-hit-rate"] == "50.0%"
    assert field["ram-entries"] == str(stats["cache"]["ram"]["entries"])
    assert field["ssd-max"] == "unlimited"
    assert field["ssd-disk-full"] == "no"
    assert re.fullmatch(r"\d+ \(.+\)", field["ssd-pending"])
    error = re.search(r'<div id="error"[^>]*>([^<]*)<', done.stdout)
    assert error is not None and error.group(1) == "", "the page read /stats without errors"


def test_screenshot_renders(live, tmp_path):
    _, url = live
    binary = find_chromium()
    png = tmp_path / "status.png"
    done = chromium(binary, tmp_path / "profile", f"--screenshot={png}", url=url)
    assert done.returncode == 0 and png.exists(), done.stderr[-2000:]
    pixels = png_pixels(png.read_bytes())[..., :3]
    assert pixels.shape[:2] == (HEIGHT, WIDTH)

    def colours(region: np.ndarray) -> int:
        return len(np.unique(region.reshape(-1, 3), axis=0))

    assert pixels[5:55, :].mean() < 80, "the dark header bar is drawn"
    assert colours(pixels[:60]) >= 8, "the header holds text (model name, state pill)"
    assert colours(pixels[60:]) >= 50, "the cards, text and bars are drawn (not a blank page)"
    assert pixels[100:600, 30:380].mean() > 180, "the first card is light"

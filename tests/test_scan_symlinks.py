"""The startup scan (and collection) never follows a symbolic link out of the cache directory.

Real links to a real directory outside the cache, holding files that look
like the scan's prey (tmp orphans, damaged or foreign `.mlxkv`, manifests,
blocks, generation checkpoints): every one must survive a scan, a block
collection and a real `mlxd serve` startup; the links themselves are ignored
and logged, neither followed nor unlinked, and the store's own files are
indexed as before.
"""

from __future__ import annotations

import signal
from pathlib import Path

import mlx.core as mx
from mlx_lm.models import cache as mlc

from mlxd.kv import file_format as ff
from mlxd.kv import kinds
from mlxd.kv.block_store import BLOCK_EXT
from mlxd.kv.ssd_store import Failed, SsdStore, StoreIdentity, compute_fingerprint, namespace_dir

from procs import ServeProcess
from ssd_files import checkpoint_files

FP = compute_fingerprint({"config": "symlinks"})
IDENTITY = StoreIdentity(model_id="tiny", fingerprint=FP, tokenizer_hash="tok")
BLOCK_NAME = "ab" * 16  # a well-formed block name no manifest names: garbage, were it ours

PREY = {
    "orphan.mlxkv.tmp": b"looks like a dead writer's tmp file",
    "damaged.mlxkv": b"looks like a corrupt cache file",
    "gone.mlxmf": b"looks like a damaged manifest",
    "gone.mlxmf.tmp": b"looks like a manifest tmp file",
    BLOCK_NAME + BLOCK_EXT: b"looks like an unreferenced block",
    BLOCK_NAME + BLOCK_EXT + ".tmp": b"looks like a block tmp file",
    "key.mlxgen": b"looks like a damaged generation checkpoint",
    "key.mlxgen.tmp": b"looks like a checkpoint tmp file",
}


def outside(tmp_path: Path, name: str = "outside") -> Path:
    d = tmp_path / name
    d.mkdir()
    for file, data in PREY.items():
        (d / file).write_bytes(data)
    return d


def assert_untouched(d: Path) -> None:
    assert {p.name: p.read_bytes() for p in d.iterdir()} == PREY


def plan(tokens: list[int]) -> ff.SnapshotPlan:
    c = mlc.KVCache()
    keys = mx.arange(len(tokens) * 16, dtype=mx.float32).reshape(1, 2, len(tokens), 8)
    c.update_and_fetch(keys, keys + 1)
    return kinds.plan_snapshot([c], meta=IDENTITY.meta(tokens, ""))


def test_linked_dirs_and_files_are_never_followed_by_the_scan(tmp_path):
    out = outside(tmp_path)
    store = SsdStore(tmp_path / "ssd", IDENTITY)
    stored = store.write(plan(list(range(1, 33))))
    assert not isinstance(stored, Failed)
    fp_dir, ns_dir = store.directory, stored.record.path.parent
    (fp_dir / namespace_dir("linked")).symlink_to(out, target_is_directory=True)  # a namespace dir
    for name in ("orphan.mlxkv.tmp", "damaged.mlxkv"):
        (ns_dir / name).symlink_to(out / name)  # single files
    (ns_dir / "dangling.mlxkv.tmp").symlink_to(tmp_path / "nowhere")

    scan = store.scan()
    assert [r.path for r in scan.records] == [stored.record.path]
    assert scan.report.corrupt == 0 and scan.report.orphans == 0
    assert_untouched(out)
    links = [fp_dir / namespace_dir("linked"), ns_dir / "orphan.mlxkv.tmp", ns_dir / "damaged.mlxkv",
             ns_dir / "dangling.mlxkv.tmp"]
    assert all(p.is_symlink() for p in links), "a link is ignored, not unlinked"
    assert store.read_record(ns_dir / "damaged.mlxkv") is None
    assert store.load(stored.record) is not None


def test_a_linked_blocks_dir_is_neither_scanned_nor_collected(tmp_path):
    out = outside(tmp_path)
    store = SsdStore(tmp_path / "ssd", IDENTITY, layout="blocks", block_tokens=16)
    store.directory.mkdir(parents=True)
    store.blocks.blocks_dir.symlink_to(out, target_is_directory=True)
    scan = store.scan()
    assert scan.records == () and scan.report.corrupt == 0
    assert store.blocks.collect().removed == 0
    assert store.blocks.collect([BLOCK_NAME]).removed == 0
    assert isinstance(store.write(plan(list(range(1, 33)))), Failed), "no block is written through a link"
    assert_untouched(out)
    assert store.blocks.blocks_dir.is_symlink()


def test_a_linked_fingerprint_dir_is_left_alone(tmp_path):
    out = outside(tmp_path)
    root = tmp_path / "ssd"
    root.mkdir()
    (root / FP).symlink_to(out, target_is_directory=True)
    for layout in ("whole", "blocks"):
        store = SsdStore(root, IDENTITY, layout=layout)
        assert store.scan().records == ()
        assert_untouched(out)


def test_serve_startup_follows_no_link(tmp_path, tiny_model_dir):
    """A real server: links to outside directories in place of a namespace dir, a file and the
    generation-checkpoint dir; the files behind them survive its startup and its shutdown."""
    cache = tmp_path / "ssd"

    def serve(name: str) -> ServeProcess:
        return ServeProcess("--model", str(tiny_model_dir), "--model-name", "tiny", "--ssd-cache", str(cache),
                            "--generation-checkpoint", "16", log_path=tmp_path / f"{name}.log")

    body = {"model": "tiny", "prompt": "Links lead out of the cache directory; the scan stays in. " * 6,
            "max_tokens": 4, "temperature": 0}
    with serve("first") as first, first.client() as http:
        assert http.post("/v1/completions", json=body).status_code == 200
        assert http.post("/admin/cache/flush").json()["durable"] is True
        first.signal(signal.SIGTERM)
        assert first.wait() == 0
    (fp_dir,) = [d for d in cache.iterdir() if d.is_dir() and d.name != "generations"]
    (ns_dir,) = [d for d in fp_dir.iterdir() if d.is_dir() and d.name != "blocks"]
    kept = checkpoint_files(ns_dir)
    assert kept
    out_ns, out_file, out_gen = outside(tmp_path, "ns"), outside(tmp_path, "file"), outside(tmp_path, "gen")
    (fp_dir / namespace_dir("linked")).symlink_to(out_ns, target_is_directory=True)
    (ns_dir / "damaged.mlxkv").symlink_to(out_file / "damaged.mlxkv")
    (ns_dir / "orphan.mlxkv.tmp").symlink_to(out_file / "orphan.mlxkv.tmp")
    (cache / "generations").mkdir(exist_ok=True)
    gen_dir = cache / "generations" / fp_dir.name
    if gen_dir.exists():
        gen_dir.rmdir()  # empty after a clean shutdown
    gen_dir.symlink_to(out_gen, target_is_directory=True)

    with serve("second") as second, second.client() as http:
        again = http.post("/v1/completions", json=body).json()
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] > 0, "its own files still restore"
        second.signal(signal.SIGTERM)
        assert second.wait() == 0
    for d in (out_ns, out_file, out_gen):
        assert_untouched(d)
    assert (ns_dir / "damaged.mlxkv").is_symlink() and gen_dir.is_symlink()
    assert "ssd_symlink_ignored" in second.log() and "gen_checkpoint.symlink_ignored" in second.log()

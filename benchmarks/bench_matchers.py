"""Grammar matchers side by side: llguidance vs outlines-core.

For each tokenizer (the tiny test model's 1,024-token BPE and a 32k BPE
trained offline on the corpus plus Python's stdlib sources) and each
constraint (any JSON object, a nested JSON schema, a regex, a Lark grammar)
it times, for each library and for llguidance behind mlxd.structured (a bool
mask, a checked consume): the tokenizer setup, a cold compile (grammar +
first mask), a cached start (a fresh row from the compiled form + first
mask), and per token of a fixed valid output: the mask (the libraries: into a
packed int32 bitmask) and the consume. Each cell runs in its own process under a time limit, since
some compiles take minutes.

    python benchmarks/bench_matchers.py [--reps 5] [--cell-timeout 180]

The figures go to benchmarks/results/matchers-<timestamp>.json.
"""

from __future__ import annotations

import argparse
import json
import pickle
import statistics
import subprocess
import sys
import sysconfig
import tempfile
import time
from collections.abc import Callable, Iterator
from importlib.metadata import version
from pathlib import Path
from typing import Any

import numpy as np
from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

from mlxd.model import bpe
from mlxd.model.presets import get_preset
from mlxd.structured.matcher import GrammarCache, Matcher, vocabulary_from_json
from mlxd.structured.spec import Constraint, llguidance_grammar

EOS = bpe.SPECIAL_TOKENS.index(bpe.IM_END)

NESTED_SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 40},
        "status": {"enum": ["active", "inactive", "pending"]},
        "age": {"type": "integer"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 5},
        "address": {
            "type": "object",
            "properties": {
                "street": {"type": "string"},
                "city": {"type": "string"},
                "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
            },
            "required": ["street", "city"],
            "additionalProperties": False,
        },
        "scores": {"type": "array", "items": {"type": "number"}},
    },
    "required": ["name", "status", "tags", "address"],
    "additionalProperties": False,
}
NESTED_SAMPLE = {
    "name": "Ada Lovelace", "status": "active", "age": 36, "tags": ["math", "engines"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "10001"},
    "scores": [9.5, 7.25, 10],
}
REGEX = r"[A-Z][a-z]{2,10} [0-9]{1,3}(\.[0-9]{2})? (USD|EUR|GBP)"
LARK = """
start: expr
expr: term (("+" | "-") term)*
term: factor (("*" | "/") factor)*
factor: NUMBER | "(" expr ")"
NUMBER: /[0-9]+/
"""


def json_text(value: Any) -> str:
    return json.dumps(value, separators=(", ", ": "))


# name -> (kind, source, a valid output to walk)
CASES: dict[str, tuple[str, str, str]] = {
    "json_object": ("json_schema", json.dumps({"type": "object"}),
                    json_text({"id": 17, "name": "widget", "tags": ["a", "b"], "dims": {"w": 2.5}, "ok": True})),
    "json_schema": ("json_schema", json.dumps(NESTED_SCHEMA), json_text(NESTED_SAMPLE)),
    "regex": ("regex", REGEX, "Coffee 12.50 EUR"),
    "lark": ("lark", LARK, "(12+3)*4-5/(6+78)*9"),
}


# ---- tokenizers (built offline) ----

def stdlib_texts(limit_chars: int) -> Iterator[str]:
    yield from bpe.corpus_chunks()
    total = 0
    for path in sorted(Path(sysconfig.get_paths()["stdlib"]).rglob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        yield text
        total += len(text)
        if total > limit_chars:
            return


def train_large(vocab_size: int) -> Tokenizer:
    """A byte-level BPE like bpe.train_tokenizer, on the corpus plus ~20 MB of stdlib code."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(bpe.SPLIT_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size - len(bpe.MARKER_TOKENS), min_frequency=2,
        special_tokens=list(bpe.SPECIAL_TOKENS), initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(stdlib_texts(20_000_000), trainer=trainer)
    tokenizer.add_tokens([AddedToken(t, special=False, normalized=False) for t in bpe.MARKER_TOKENS])
    return tokenizer


def token_bytes(tokenizer: Tokenizer) -> dict[int, bytes]:
    """Each regular token's bytes; markers as their text; specials left out."""
    chars = _byte_chars()
    added = {t.content for t in tokenizer.get_added_tokens_decoder().values()}
    out = {}
    for text, i in tokenizer.get_vocab(with_added_tokens=True).items():
        if text in bpe.SPECIAL_TOKENS:
            continue
        out[i] = text.encode() if text in added else bytes(chars[c] for c in text)
    return out


def _byte_chars() -> dict[str, int]:
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = list(bs)
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


# ---- one cell: a library x tokenizer x case, in its own process ----

def timed(fn: Callable[[], Any]) -> tuple[float, Any]:
    start = time.perf_counter()
    out = fn()
    return time.perf_counter() - start, out


def walk(start: Callable[[], Any], mask: Callable[[Any], None], consume: Callable[[Any, int], bool],
         tokens: list[int]) -> tuple[float, float]:
    """Mask then consume each token of a valid output; mean seconds per token of each."""
    row = start()
    t_mask = t_consume = 0.0
    for tok in tokens:
        t0 = time.perf_counter()
        mask(row)
        t1 = time.perf_counter()
        if not consume(row, tok):
            raise RuntimeError(f"token {tok} refused")
        t_consume += time.perf_counter() - t1
        t_mask += t1 - t0
    mask(row)
    return t_mask / len(tokens), t_consume / len(tokens)


def constraint(case: str) -> Constraint:
    kind, source, _ = CASES[case]
    return Constraint({"json_schema": "json_schema", "regex": "regex", "lark": "grammar"}[kind], source)


def cell_llguidance(tok_path: str, case: str, reps: int) -> dict[str, Any]:
    """llguidance's own API, on the grammar mlxd.structured gives it (one-line JSON)."""
    import llguidance as llg
    import llguidance.numpy as llnp

    sample = CASES[case][2]
    t_tok, lltok = timed(lambda: llg.LLTokenizer(Path(tok_path).read_text(), eos_token=[EOS]))
    grammar = llguidance_grammar(constraint(case))
    bitmask = llnp.allocate_token_bitmask(1, lltok.vocab_size)

    def first(row: Any) -> Any:
        llnp.fill_next_token_bitmask(row, bitmask)
        if row.is_error():
            raise RuntimeError(row.get_error())
        return row

    t_cold, template = timed(lambda: first(llg.LLMatcher(lltok, grammar, log_level=0)))
    t_cached, _ = timed(lambda: first(template.deep_copy()))
    tokens = Tokenizer.from_file(tok_path).encode(sample).ids
    walks = [walk(template.deep_copy, lambda r: llnp.fill_next_token_bitmask(r, bitmask),
                  lambda r, t: r.consume_token(t), tokens) for _ in range(reps)]
    return _cell(t_tok, t_cold, t_cached, None, None, tokens, walks)


def cell_outlines(tok_path: str, case: str, reps: int) -> dict[str, Any]:
    import outlines_core as oc
    from outlines_core.json_schema import build_regex_from_schema

    kind, source, sample = CASES[case]
    if kind == "lark":
        return {"unsupported": "no context-free grammars (regex and JSON schema only)"}
    tokenizer = Tokenizer.from_file(tok_path)

    def vocabulary() -> Any:
        by_bytes: dict[bytes, list[int]] = {}
        for i, b in token_bytes(tokenizer).items():
            by_bytes.setdefault(b, []).append(i)
        return oc.Vocabulary(EOS, by_bytes)

    t_tok, vocab = timed(vocabulary)
    n_vocab = tokenizer.get_vocab_size()
    bitmask: np.ndarray = np.full((1, (n_vocab + 31) // 32), -1, dtype=np.int32)

    def fill(guide: Any) -> None:
        guide.write_mask_into(bitmask.ctypes.data, bitmask.size, 4)

    def first(guide: Any) -> Any:
        fill(guide)
        return guide

    regex = build_regex_from_schema(source) if kind == "json_schema" else source
    t_cold, index = timed(lambda: oc.Index(regex, vocab))
    t_cold += timed(lambda: first(oc.Guide(index)))[0]
    t_cached, _ = timed(lambda: first(oc.Guide(index)))
    blob = pickle.dumps(index)
    t_load, _ = timed(lambda: first(oc.Guide(pickle.loads(blob))))
    tokens = tokenizer.encode(sample).ids

    def consume(guide: Any, tok: int) -> bool:
        guide.advance(tok, return_tokens=False)
        return True

    walks = [walk(lambda: oc.Guide(index), fill, consume, tokens) for _ in range(reps)]
    return _cell(t_tok, t_cold, t_cached, t_load, len(blob), tokens, walks)


def cell_mlxd(tok_path: str, case: str, reps: int) -> dict[str, Any]:
    """llguidance through mlxd.structured: a bool mask of the vocab, and a checked consume."""
    sample = CASES[case][2]
    t_tok, vocab = timed(lambda: vocabulary_from_json(Path(tok_path).read_text(), eos_ids=[EOS]))
    cache = GrammarCache(vocab)

    def first(row: Matcher) -> Matcher:
        row.allowed_mask()
        return row

    t_cold, _ = timed(lambda: first(cache.matcher(constraint(case))))
    t_cached, _ = timed(lambda: first(cache.matcher(constraint(case))))
    tokens = Tokenizer.from_file(tok_path).encode(sample).ids
    walks = [walk(lambda: cache.matcher(constraint(case)), lambda r: r.allowed_mask(),
                  lambda r, t: r.consume(t), tokens) for _ in range(reps)]
    return _cell(t_tok, t_cold, t_cached, None, None, tokens, walks)


def _cell(t_tok: float, t_cold: float, t_cached: float, t_load: float | None, size: int | None,
          tokens: list[int], walks: list[tuple[float, float]]) -> dict[str, Any]:
    """Figures in ms (setup, compile) and µs (per token); per-token medians skip the first walk."""
    warm = walks[1:] or walks
    return {
        "tokenizer_setup_ms": t_tok * 1e3,
        "compile_cold_ms": t_cold * 1e3,
        "start_cached_ms": t_cached * 1e3,
        "load_persisted_ms": None if t_load is None else t_load * 1e3,
        "persisted_bytes": size,
        "sample_tokens": len(tokens),
        "mask_us_first_walk": walks[0][0] * 1e6,
        "mask_us": statistics.median(w[0] for w in warm) * 1e6,
        "consume_us": statistics.median(w[1] for w in warm) * 1e6,
    }


CELLS = {"llguidance": cell_llguidance, "outlines-core": cell_outlines, "mlxd.structured": cell_mlxd}
PACKAGES = {"llguidance": "llguidance", "outlines-core": "outlines-core", "mlxd.structured": "llguidance"}


# ---- the driver ----

def run_cell(lib: str, tok_path: Path, case: str, reps: int, timeout: float) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--cell", lib, str(tok_path), case, "--reps", str(reps)]
    try:
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"timeout_s": timeout}
    if done.returncode != 0:
        return {"error": done.stderr.strip().splitlines()[-1] if done.stderr.strip() else f"rc {done.returncode}"}
    return json.loads(done.stdout)


def fmt(value: Any, unit: str) -> str:
    return "—" if value is None else f"{value:,.1f} {unit}" if value >= 10 else f"{value:.2f} {unit}"


def describe(cell: dict[str, Any]) -> str:
    if "unsupported" in cell:
        return "not supported"
    if "timeout_s" in cell:
        return f"compile > {cell['timeout_s']:.0f} s (stopped)"
    if "error" in cell:
        return f"error: {cell['error'][:60]}"
    return (f"cold {fmt(cell['compile_cold_ms'], 'ms')}, cached {fmt(cell['start_cached_ms'], 'ms')}, "
            f"mask {fmt(cell['mask_us'], 'µs')}, consume {fmt(cell['consume_us'], 'µs')}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reps", type=int, default=5, help="walks per cell (the first counts as cold)")
    parser.add_argument("--cell-timeout", type=float, default=180.0)
    parser.add_argument("--large-vocab", type=int, default=32_768)
    parser.add_argument("--cell", nargs=3, metavar=("LIB", "TOKENIZER_JSON", "CASE"), help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.cell:
        lib, tok_path, case = args.cell
        print(json.dumps(CELLS[lib](tok_path, case, args.reps)))
        return 0

    with tempfile.TemporaryDirectory(prefix="bench-matchers-") as tmp:
        tokenizers = {
            "tiny-1024": bpe.train_tokenizer(get_preset("test").vocab_size),
            f"bpe-{args.large_vocab // 1024}k": train_large(args.large_vocab),
        }
        results: dict[str, Any] = {}
        for tok_name, tok in tokenizers.items():
            path = Path(tmp) / f"{tok_name}.json"
            tok.save(str(path))
            for case in CASES:
                for lib in CELLS:
                    cell = run_cell(lib, path, case, args.reps, args.cell_timeout)
                    results.setdefault(tok_name, {}).setdefault(case, {})[lib] = cell
                    print(f"{tok_name:10} {case:12} {lib:16} {describe(cell)}", flush=True)

    out = {
        "benchmark": "matchers",
        "argv": sys.argv[1:],
        "versions": {pkg: version(pkg) for pkg in set(PACKAGES.values())},
        "cases": {k: {"kind": v[0], "source": v[1], "sample": v[2]} for k, v in CASES.items()},
        "results": results,
    }
    dest = Path(__file__).parent / "results" / f"matchers-{time.strftime('%Y%m%d-%H%M%S')}.json"
    dest.write_text(json.dumps(out, indent=2) + "\n")
    print(dest)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Regenerate `corpus.txt`, the text the offline tokenizer is trained on.

The corpus ships with the package so every machine trains the same tokenizer,
whatever its Python version. It was made once with:

    python -m mlxd.model.make_corpus src/mlxd/model/corpus.txt

It holds the docstrings of a fixed list of standard-library modules (read from
source with `ast`, never imported) followed by a few hand-written lines of chat,
code and non-English text so common UTF-8 sequences get merges too.
"""

from __future__ import annotations

import ast
import importlib.util
import sys
from pathlib import Path

MAX_DOCSTRING_BYTES = 640_000

MODULES = (
    "os", "re", "json", "collections", "functools", "itertools", "pathlib",
    "subprocess", "argparse", "logging", "typing", "dataclasses", "threading",
    "email.message", "http.client", "urllib.parse", "string", "textwrap",
    "difflib", "inspect", "pydoc", "unittest.case", "decimal", "fractions",
    "statistics", "random", "datetime", "calendar", "csv", "shutil", "tempfile",
    "zipfile", "tarfile", "socket", "ssl", "enum", "abc", "contextlib", "heapq",
    "bisect", "queue", "sched", "pickle", "copy", "pprint", "traceback",
    "warnings", "doctest", "optparse", "configparser", "gettext", "locale",
    "codecs", "base64", "hashlib", "hmac", "secrets", "uuid", "ipaddress",
    "mimetypes", "smtplib", "imaplib", "ftplib", "xml.dom.minidom", "html.parser",
    "sqlite3", "turtle", "wave", "colorsys", "glob", "fnmatch", "linecache",
    "tokenize", "ast", "dis", "timeit", "cProfile", "pdb", "bdb", "trace", "cmd",
    "shlex", "getopt", "selectors", "signal", "types", "operator", "numbers",
)  # fmt: skip

EXTRA_TEXT = """\
User: Hello! Can you explain what a prompt cache does?
Assistant: Sure. A prompt cache keeps the attention keys and values of a
conversation prefix, so the next turn only has to process the new tokens.

def fibonacci(n: int) -> int:
    a, b = 0, 1
    for _ in range(n):
        a, b = b, a + b
    return a

async def main() -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker, send_channel.clone())

{"role": "user", "content": "What is 2 + 2?"} -> {"role": "assistant", "content": "4"}

Français : Le café est très chaud, n'est-ce pas ? Où est la gare ?
Deutsch: Grüße aus München! Die Straße ist schön, und das Wetter ist gut.
Español: ¿Dónde está la biblioteca? ¡Mañana vamos a la playa!
Português: Ação, informação, coração e pão.
Русский: Привет, мир! Как дела? Спасибо, хорошо.
Ελληνικά: Γειά σου κόσμε. Ευχαριστώ πολύ.
中文：你好，世界！今天天气很好。我们一起学习。
日本語：こんにちは、世界。今日はいい天気ですね。ありがとうございます。
한국어: 안녕하세요, 세계! 감사합니다.
العربية: مرحبا بالعالم. شكرا جزيلا.
हिन्दी: नमस्ते दुनिया। धन्यवाद।
Emoji: 😀 😃 😄 😁 🙂 👍 🎉 🚀 ❤️ 🔥 ✅ ❌ ⚡ 🌍 👋🏽 👨‍👩‍👧‍👦 🏳️‍🌈
Math: ∑ ∫ √ ∞ ≈ ≠ ≤ ≥ ± × ÷ π λ Δ → ← ⇒ ∀ ∃ ∈
"""


def stdlib_docstrings() -> str:
    """Docstrings of MODULES, in order, capped at MAX_DOCSTRING_BYTES."""
    texts: list[str] = []
    size = 0
    for name in MODULES:
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        tree = ast.parse(Path(spec.origin).read_text(encoding="utf-8"))
        for node in ast.walk(tree):
            if not isinstance(node, ast.Module | ast.FunctionDef | ast.ClassDef):
                continue
            doc = ast.get_docstring(node)
            if not doc:
                continue
            size += len(doc.encode()) + 2
            if size > MAX_DOCSTRING_BYTES:
                return "\n\n".join(texts)
            texts.append(doc)
    return "\n\n".join(texts)


def main(argv: list[str] | None = None) -> None:
    out = Path((argv or sys.argv[1:] or ["corpus.txt"])[0])
    out.write_text(EXTRA_TEXT + "\n" + stdlib_docstrings() + "\n", encoding="utf-8")


if __name__ == "__main__":
    main()

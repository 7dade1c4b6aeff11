"""The `mlxd` command: serve, simulate, build-model, build-adapter."""

from __future__ import annotations

import argparse
import faulthandler
import math
import os
import shutil
import signal
import sys
from pathlib import Path
from typing import NoReturn

from mlxd.runtime.config import GB


def _gb(text: str) -> int:
    return int(_finite_non_negative_float(text) * GB)


class DiskShare(float):
    """`--ssd-cache-max N%`: a fraction of the space the SSD tier may use, resolved once at start
    (`disk_share_bytes`)."""


def _ssd_cap(text: str) -> int | DiskShare:
    """`--ssd-cache-max`: GB of KV bytes, or `N%` of the disk space the tier may use at start."""
    if text.strip().endswith("%"):
        percent = float(text.strip()[:-1])
        if not 0 < percent <= 100:
            raise argparse.ArgumentTypeError("a share of the disk must be a percentage in (0, 100]")
        return DiskShare(percent / 100)
    return _gb(text)


def disk_share_bytes(directory: Path, share: float) -> int:
    """`share` of what the SSD tier at `directory` may use: the free space of its filesystem plus the bytes of
    the files already in it (the tier's own, from an earlier run), at least 1 byte (0 would mean no cap)."""
    existing = directory
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    own = 0
    if directory.is_dir():
        for root, _dirs, files in os.walk(directory):
            for name in files:
                try:
                    own += os.lstat(os.path.join(root, name)).st_size
                except OSError:  # a file another replica just removed
                    pass
    return max(1, int(share * (shutil.disk_usage(existing).free + own)))


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError("must be >= 1")
    return value


def _prefill_step(text: str) -> int | str:
    return "auto" if text == "auto" else _positive_int(text)


def _non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError("must be >= 0")
    return value


def _finite_non_negative_float(text: str) -> float:
    """A size or a rate (converted to whole bytes: int(inf) would be an OverflowError's traceback)."""
    value = float(text)
    if not 0 <= value < math.inf:
        raise argparse.ArgumentTypeError("must be a finite number >= 0")
    return value


def _positive_float(text: str) -> float:
    value = float(text)
    if not value > 0:
        raise argparse.ArgumentTypeError("must be > 0")
    return value


def _secret(flag: str | None, env: str) -> str | None:
    """A key from its flag or else its environment variable; empty means unset."""
    value = flag if flag is not None else os.environ.get(env)
    return value or None


def _adapter_spec(text: str) -> tuple[str, str]:
    """--adapter NAME=DIR -> (name, dir)."""
    name, sep, directory = text.partition("=")
    name, directory = name.strip(), directory.strip()
    if not sep or not name or not directory or any(c.isspace() for c in name) or "/" in name:
        raise argparse.ArgumentTypeError(f"expected NAME=DIR (a name without spaces or /, and an mlx-lm "
                                         f"adapter directory), got {text!r}")
    return name, directory


def _preset_names() -> list[str]:
    from mlxd.model.presets import PRESETS

    return sorted(PRESETS)


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("serve", help="serve the OpenAI-compatible HTTP API")
    p.add_argument("--model", help="local model directory or Hugging Face repo id (default: a built-in model)")
    p.add_argument("--preset", default="default", choices=_preset_names(), metavar="PRESET",
                   help="built-in random-weight model when --model is not given: default, bench, test, test-wide, "
                   "test-gemma3 (sliding window), test-qwen3next (hybrid), test-mamba2 (recurrent), "
                   "test-vlm and bench-vlm (vision)")
    p.add_argument("--model-name", help="name to serve the model under (default: --model)")
    p.add_argument("--chat-template", metavar="FILE",
                   help="a Jinja chat template file used instead of the model's own (its tool-call format "
                   "is inferred from it, as mlx-lm does for the model's)")
    p.add_argument("--adapter", type=_adapter_spec, action="append", default=[], metavar="NAME=DIR",
                   help="serve an mlx-lm LoRA adapter directory (adapter_config.json + adapters.safetensors) "
                   "as model NAME; repeatable. Rows of different adapters and the base batch together; each "
                   "adapter is its own cache namespace (docs/adapters.md)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8080, help="port to bind (default 8080; 0 picks a free port)")
    p.add_argument("--prompt-cache-gb", type=_gb, default=2 * GB, help="RAM prompt-cache byte cap in GB (0 disables)")
    p.add_argument("--host-cache-gb", type=_gb, default=0,
                   help="host-memory tier in GB between the RAM tier and SSD: RAM victims move there instead of "
                   "leaving (CUDA; a logged no-op on unified memory: CPU, Apple); 0 disables (default)")
    p.add_argument("--ram-pages", choices=("on", "off"), default="off",
                   help="hold RAM entries as shared KV pages, so conversations over one prefix hold it once "
                   "(attention-only models; others stay contiguous, logged); off = one contiguous copy per "
                   "entry (default; docs/operations.md#paged-ram-tier)")
    p.add_argument("--ram-page-tokens", type=_positive_int, metavar="N",
                   help="tokens per RAM page with --ram-pages on (default: the SSD block span, "
                   "--ssd-block-tokens or sized from the model's KV bytes per token)")
    p.add_argument("--retention", choices=("lru", "lfu", "cost"), default="lru", help="RAM retention policy")
    p.add_argument("--kv-bits", type=int, choices=(4, 8),
                   help="store attention KV affine-quantized to 4 or 8 bits (default: the model's precision)")
    p.add_argument("--kv-group-size", type=int, choices=(32, 64, 128), default=64,
                   help="quantization group size along head_dim for --kv-bits (default 64)")
    p.add_argument("--memory-budget", type=_gb, metavar="GB",
                   help="MLX memory (weights, batches and the RAM cache) to keep to: past it, durable RAM "
                   "entries demote to SSD, or are evicted without --ssd-cache (default: 0.9 x the GPU's "
                   "recommended working set, else 0.75 x the GPU's memory or RAM; 0 = no budget)")
    p.add_argument("--kv-admission", action="store_true",
                   help="start a request only when its KV (prompt + max_tokens, and the draft model's) and its "
                   "prefill working memory fit the memory budget beside this runtime's measured memory, the "
                   "running rows and the RAM the tiers cannot free; else it waits in the queue, and one that "
                   "never fits gets a 400 at once")
    p.add_argument("--max-batch", type=_positive_int, default=8, help="rows decoding together")
    p.add_argument("--prefill-batch", type=_positive_int, default=8,
                   help="prompts prefilled together (capped at --max-batch)")
    p.add_argument("--max-queue", type=_non_negative_int, default=32, help="requests waiting for a slot before 503")
    p.add_argument("--queue-timeout", type=_non_negative_float, default=60.0, metavar="SEC",
                   help="seconds an HTTP request may wait in the queue for a batch slot before it gets a 503; one "
                   "the prompts already admitted would hold longer (at the measured rate) gets it at once "
                   "(0 = no limit)")
    p.add_argument("--ttft-timeout", type=_non_negative_float, default=0.0, metavar="SEC",
                   help="seconds from arrival to a request's first token; past it the request is cancelled and "
                   "answered 503, and a stream's headers wait for its first token (0 = no limit)")
    p.add_argument(
        "--prefill-step-size", type=_prefill_step, default=None,
        help="prefill chunk size in tokens, or 'auto' (default: 2048; on a GPU timed at startup when the device probe runs)",
    )
    p.add_argument("--prefill-slice-ms", type=_non_negative_float, default=50.0, metavar="MS",
                   help="milliseconds of prefill per engine step: a long prompt is prefilled in slices this long "
                   "so other requests prefill and decode between them (0 = whole --prefill-step-size chunks)")
    p.add_argument(
        "--device-probe", choices=("auto", "on", "off"), default="auto",
        help="measure prefill, decode and restore speed before listening (auto: with --ssd-cache, reusing the "
        "last server's probe saved beside its files on this device and setup; on: always measure)",
    )
    p.add_argument(
        "--device-probe-budget", type=float, default=3.0, metavar="S",
        help="seconds the startup device probe may spend on prefills (default 3)",
    )
    p.add_argument(
        "--device-warmup", choices=("auto", "on", "off"), default="auto",
        help="before listening, run the device probe's longest prefill once, untimed, by serving's own prefill "
        "paths, so the first request does not build their kernels (auto: on a GPU; on: on any device)",
    )
    p.add_argument("--max-tokens-limit", type=_positive_int, default=8192, help="cap on a request's max_tokens")
    p.add_argument("--ssd-cache", type=Path, metavar="DIR", help="SSD cold tier directory (off unless set)")
    p.add_argument("--ssd-cache-max", type=_ssd_cap, metavar="GB/N%",
                   help="SSD tier cap in GB of KV bytes, or N%% of the disk space the tier may use at start (the "
                   "filesystem's free space plus the tier's own files), resolved once (default: unlimited: on a "
                   "full disk writes fail and the server serves from RAM)")
    p.add_argument("--ssd-shared", action="store_true",
                   help="other replicas use the same --ssd-cache directory: pick up their files, and delete "
                   "only as the directory's one collector (see docs/fleet.md)")
    p.add_argument("--ssd-rescan", type=_positive_float, metavar="SEC",
                   help="with --ssd-shared: how often to look for other replicas' files (default 1)")
    p.add_argument("--ssd-cache-verify", choices=("on", "off"), nargs="?", const="on", default=None,
                   help="check every restored byte against its file's per-tensor CRC-32 checksums, generation "
                        "checkpoints included; a damaged file is a miss (default on; off checks only the hashed "
                        "header, layout and size: see docs/benchmarks.md for the cost)")
    p.add_argument("--restore-landing", choices=("auto", "mlx", "host"), default="auto",
                   help="where restored bytes are read to: straight into MLX arrays (mlx), or a host buffer "
                        "copied in by the engine (host); auto = mlx on CUDA and the CPU, host on Apple GPUs")
    p.add_argument("--restore-choice", choices=("measured", "always", "never", "split", "overlap"), default=None,
                   help="restore a cold prefix only when the measured costs say it beats prefilling it again, "
                        "whole or (block layout) its leading blocks (measured, the default), every time it is "
                        "longer than RAM's prefix (always), never (never: the recompute arm, to compare), or a middle part of it, the rest prefilled (split: tests), "
                        "or recompute its first part while its last part is read, at the cut the costs put first (overlap: tests, benchmarks)")
    p.add_argument("--restore-overlap", choices=("on", "off"), default=None,
                   help="with --restore-choice measured and the block layout, also weigh recomputing a cold "
                        "prefix's first part while its last part is read from SSD, where that beats both and no other "
                        "row is in the engine (on, the default; off: never)")
    p.add_argument("--ssd-demote-idle", type=float, metavar="SEC",
                   help="demote RAM entries idle this long to SSD (default 300; 0 disables)")
    p.add_argument("--ssd-write-rate", type=_finite_non_negative_float, metavar="MB/S",
                   help="write-behind rate while the engine is decoding (default 24; 0 = unpaced); full speed "
                   "when idle, when a flush waits, or when the unwritten backlog passes half the RAM tier")
    p.add_argument("--ssd-backlog-gb", type=_gb, metavar="GB",
                   help="unwritten checkpoint bytes past which write-behind is urgent (full speed, even beside "
                        "decode; default 0: half of --prompt-cache-gb)")
    p.add_argument("--ssd-write-hold-decode", action="store_true", default=None,
                   help="hold write-behind still while rows decode, as while a prompt waits for its first token, "
                        "even past the backlog bound (at most 2 s a hold, then one piece goes; a flush or RAM over "
                        "its cap is never held)")
    p.add_argument("--generation-checkpoint", type=_non_negative_int, default=0, metavar="N",
                   help="checkpoint running generations every N tokens to the SSD tier, so an identical "
                        "request resumes after a crash or disconnect (default 0: off; needs --ssd-cache)")
    p.add_argument("--speculative", choices=("off", "ngram", "draft"), default="off",
                   help="speculative decoding: ngram = each row drafts tokens copied from its own prompt and output "
                        "(prompt lookup), draft = a small model drafts them (--draft-model); verified in one forward, "
                        "output is unchanged (default off; docs/speculative.md)")
    p.add_argument("--draft-model", metavar="DIR",
                   help="with --speculative draft: a local model directory with the model's tokenizer (checked)")
    p.add_argument("--num-draft-tokens", type=_positive_int, default=4, metavar="K",
                   help="with --speculative: the most draft tokens a row proposes at a try; each try's length, "
                        "K or fewer, is chosen from what verifying costs (MLXD_DRAFT_LENGTH=fixed: always K; "
                        "default 4; docs/speculative.md)")
    p.add_argument("--ssd-layout", choices=("whole", "blocks"), default=None,
                   help="store new checkpoints as shared content-addressed blocks plus a manifest (default: a "
                   "shared prefix is stored once) or as whole files; both are always read")
    p.add_argument("--ssd-block-tokens", type=_positive_int, metavar="N",
                   help="tokens per block with the blocks layout (default: sized to ~16 MiB of KV, >= 256)")
    p.add_argument("--shutdown-timeout", type=float, default=60.0,
                   help="seconds to drain and flush on SIGTERM (with an SSD tier, the last quarter is kept for the flush)")
    p.add_argument("--api-key", help="require 'Authorization: Bearer KEY' on the API (env MLXD_API_KEY)")
    p.add_argument("--admin-key", help="require this bearer token on /admin/* (env MLXD_ADMIN_KEY); without "
                   "it, admin routes are refused on a non-loopback --host")
    p.add_argument("--request-timeout", type=_non_negative_float, default=0.0, metavar="SEC",
                   help="end-to-end seconds per request; a cut generation ends with finish_reason "
                   "'length' (0 = no limit)")
    p.add_argument("--max-body-mb", type=_positive_float, default=16.0, metavar="MB",
                   help="largest request body in MiB (larger ones get 413)")
    p.add_argument("--max-connections", type=_non_negative_int, default=0, metavar="N",
                   help="open HTTP connections; past it a new connection gets a 503 and is closed (0 = half the "
                   "process's file-handle limit, at most 4096)")
    p.add_argument("--keep-alive-timeout", type=_positive_float, default=20.0, metavar="SEC",
                   help="seconds an idle keep-alive connection, or one that sends nothing, stays open (default 20: "
                        "longer than clients keep idle connections, so they close first)")
    p.add_argument("--allow-media-dir", type=Path, metavar="DIR",
                   help="vision models: accept file:// image URLs under DIR (off: data: URLs only; http(s) never)")
    p.add_argument("--max-images", type=int, default=16, metavar="N", help="vision models: images per request")
    p.add_argument("--max-image-mb", type=_positive_float, default=20.0, metavar="MB",
                   help="vision models: encoded bytes of one image, in MiB")
    p.add_argument("--kv-events-endpoint", metavar="URL",
                   help="publish KV cache block events in vLLM's ZMQ format: tcp://*:5557 binds 127.0.0.1:5557 "
                   "(subscribers on this host connect), tcp://indexer:5557 connects to a subscriber that binds, "
                   "ipc://PATH binds a Unix socket; needs pyzmq and msgpack (pip install 'mlxd[fleet]')")
    p.add_argument("--kv-events-all-interfaces", action="store_true",
                   help="let a wildcard --kv-events-endpoint (tcp://*:PORT, tcp://0.0.0.0:PORT) bind every network "
                   "interface: anyone who reaches the port sees what this server caches (see SECURITY.md)")
    p.add_argument("--kv-events-token-ids", choices=("off", "on"), default="off",
                   help="put each stored block's token ids (the prompt itself) in BlockStored events, for "
                   "indexers that hash tokens themselves (default off: block hashes only; see docs/fleet.md)")
    p.add_argument("--kv-events-block-size", type=_positive_int, default=16, metavar="TOKENS",
                   help="tokens per announced KV block (default 16)")
    p.add_argument("--distributed", action="store_true",
                   help="serve one model sharded over the processes `mlx.launch` started (tensor parallel): "
                        "rank 0 serves HTTP and decides the prompt cache (RAM tier only), the others follow and "
                        "keep their shard of each cached prefix (docs/fleet.md)")
    p.add_argument("--record-trace", type=Path, metavar="FILE",
                   help="append every finished request to FILE in mlxd's trace format (for `mlxd simulate`)")
    p.add_argument("--log-format", choices=("json", "console", "auto"), default="auto")
    p.add_argument("--log-level", default="info")


def _check_kv_events(args: argparse.Namespace) -> None:
    endpoint = args.kv_events_endpoint
    if endpoint is None:
        if args.kv_events_all_interfaces or args.kv_events_token_ids == "on":
            print("mlxd serve: warning: --kv-events-all-interfaces and --kv-events-token-ids are ignored "
                  "without --kv-events-endpoint", file=sys.stderr)
        return
    import importlib.util

    if not endpoint.startswith(("tcp://", "ipc://", "inproc://")):
        raise ValueError(f"--kv-events-endpoint {endpoint!r}: expected tcp://HOST:PORT (or ipc://PATH)")
    missing = [m for m in ("zmq", "msgpack") if importlib.util.find_spec(m) is None]
    if missing:
        raise ValueError(f"--kv-events-endpoint needs {' and '.join(missing)}: pip install 'mlxd[fleet]'")


def serve_config(args: argparse.Namespace):
    from mlxd.runtime.config import RuntimeConfig

    _check_kv_events(args)
    if args.distributed and args.ssd_cache is not None:
        raise ValueError("--distributed keeps the prompt cache in RAM only for now (each rank would need its "
                         "own shard files): leave out --ssd-cache")
    ssd = {}
    if args.ssd_cache is None:
        for flag in ("ssd_cache_max", "ssd_cache_verify", "ssd_demote_idle", "ssd_write_rate", "ssd_write_hold_decode",
                     "ssd_backlog_gb",
                     "ssd_layout", "ssd_block_tokens", "ssd_shared", "ssd_rescan"):
            if getattr(args, flag) not in (None, False):
                print(f"mlxd serve: warning: --{flag.replace('_', '-')} ignored without --ssd-cache", file=sys.stderr)
    else:
        ssd = {
            "ssd_cache_dir": args.ssd_cache,
            "ssd_cache_max_bytes": disk_share_bytes(Path(args.ssd_cache), args.ssd_cache_max)
            if isinstance(args.ssd_cache_max, DiskShare) else args.ssd_cache_max or 0,
            "ssd_cache_verify": args.ssd_cache_verify != "off",
            "restore_landing": args.restore_landing,
            **({} if args.restore_choice is None else {"restore_choice": args.restore_choice}),
            **({} if args.restore_overlap is None else {"restore_overlap": args.restore_overlap == "on"}),
            "ssd_shared": args.ssd_shared,
            **({} if args.ssd_rescan is None else {"ssd_rescan_s": args.ssd_rescan}),
            "ssd_demote_idle_s": 300.0 if args.ssd_demote_idle is None else args.ssd_demote_idle,
            **({} if args.ssd_write_rate is None else {"ssd_write_rate_bytes": int(args.ssd_write_rate * 2**20)}),
            "ssd_write_hold_decode": bool(args.ssd_write_hold_decode),
            **({} if not args.ssd_backlog_gb else {"ssd_backlog_bytes": args.ssd_backlog_gb}),
            **({} if args.ssd_layout is None else {"ssd_layout": args.ssd_layout}),
            **({} if args.ssd_block_tokens is None else {"ssd_block_tokens": args.ssd_block_tokens}),
        }
    return RuntimeConfig(
        **ssd,
        model=args.model,
        model_preset=args.preset,
        model_name=args.model_name,
        chat_template=args.chat_template,
        adapters=tuple(args.adapter),
        prompt_cache_bytes=args.prompt_cache_gb,
        host_cache_bytes=args.host_cache_gb,
        ram_pages=args.ram_pages,
        ram_page_tokens=args.ram_page_tokens or 0,
        retention=args.retention,
        kv_bits=args.kv_bits,
        kv_group_size=args.kv_group_size,
        memory_budget_bytes=args.memory_budget,
        kv_admission=args.kv_admission,
        max_batch=args.max_batch,
        prefill_batch=args.prefill_batch,
        max_queue=args.max_queue,
        queue_timeout_s=args.queue_timeout,
        ttft_timeout_s=args.ttft_timeout,
        prefill_step_size=args.prefill_step_size if isinstance(args.prefill_step_size, int) else 2048,
        prefill_slice_s=args.prefill_slice_ms / 1000,
        tune_prefill_step={None: None, "auto": True}.get(args.prefill_step_size, False),
        device_probe="off" if args.distributed else args.device_probe,
        device_probe_budget_s=args.device_probe_budget,
        device_warmup=args.device_warmup,
        max_tokens_limit=args.max_tokens_limit,
        api_key=_secret(args.api_key, "MLXD_API_KEY"),
        admin_key=_secret(args.admin_key, "MLXD_ADMIN_KEY"),
        request_timeout_s=args.request_timeout,
        max_body_bytes=int(args.max_body_mb * 1024 * 1024),
        max_connections=args.max_connections,
        keep_alive_timeout_s=args.keep_alive_timeout,
        allow_media_dir=args.allow_media_dir,
        max_images=args.max_images,
        max_image_bytes=int(args.max_image_mb * 1024 * 1024),
        generation_checkpoint=args.generation_checkpoint,
        speculative=args.speculative,
        num_draft_tokens=args.num_draft_tokens,
        draft_model=args.draft_model,
        kv_events_endpoint=args.kv_events_endpoint,
        kv_events_block_size=args.kv_events_block_size,
        kv_events_all_interfaces=args.kv_events_all_interfaces,
        kv_events_token_ids=args.kv_events_token_ids == "on",
        distributed=args.distributed,
    )


def run_serve(args: argparse.Namespace) -> int:
    import trio

    from mlxd.engine.loading import local_model_path
    from mlxd.engine.ops import ModelRefused
    from mlxd.runtime import gc_pauses
    from mlxd.runtime.logging import configure_logging, get_logger

    configure_logging(args.log_format, level=args.log_level)
    try:
        config = serve_config(args)
        freeze = gc_pauses.freeze_wanted()  # MLXD_GC_FREEZE: a typo is refused before anything loads
        if config.model is not None:
            local_model_path(config.model)  # a missing directory: refused before MLX and the tokenizers load
    except (ValueError, ModelRefused) as exc:
        print(f"mlxd serve: {exc}", file=sys.stderr)
        return 2
    from mlxd.http.connections import CannotListen
    from mlxd.kv.dir_lock import DirLocked
    from mlxd.kv.file_format import StorageError
    from mlxd.runtime.distributed import world_rank

    if config.distributed and world_rank() > 0:
        return _follow(config)
    refused: list[object] = []
    lost: str | None = None
    try:
        lost = trio.run(_serve_main, config, args, freeze)
    except* (ModelRefused, DirLocked, CannotListen) as group:  # refused at startup: exit 2 with the reason
        refused += _leaves(group)
    except* StorageError as group:  # the SSD tier's directory cannot be made or used (a file there, no access)
        refused += [f"--ssd-cache {args.ssd_cache}: {error}" for error in _leaves(group)]
    else:  # the runtime is closed (a flush's exit path: from `serve.flushed` to here, then the interpreter's)
        get_logger("mlxd.serve").info("serve.stopped")
    for error in refused:
        print(f"mlxd serve: {error}", file=sys.stderr)
    if lost is not None:
        print(f"mlxd serve: {lost}; start it again", file=sys.stderr)
        return 1
    return 2 if refused else 0


def _leaves(group: BaseExceptionGroup) -> list[BaseException]:
    """The exceptions a group holds, nested groups opened (a failed bind comes up through three nurseries)."""
    return [leaf for e in group.exceptions for leaf in (_leaves(e) if isinstance(e, BaseExceptionGroup) else [e])]


def _follow(config) -> int:
    """A follower rank of `--distributed`: no HTTP, no cache owner; the engine replays rank 0's steps.

    A follower stops when rank 0 does (rank 0 tells it), so Ctrl-C, which a
    terminal sends to every rank, is left to rank 0's graceful shutdown.
    SIGTERM still ends a follower at once (mlx.launch stops the others so
    when one rank fails).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    from mlxd.engine.ops import ModelRefused
    from mlxd.engine.ranks import follow

    try:
        follow(config)
    except ModelRefused as exc:
        print(f"mlxd serve: {exc}", file=sys.stderr)
        return 2
    except ConnectionError as exc:  # rank 0 went away without saying so
        print(f"mlxd serve: follower stopping: {exc}", file=sys.stderr)
        return 1
    return 0


async def _serve_main(config, args: argparse.Namespace, freeze: bool) -> str | None:
    import trio

    from mlxd.http.app import serve_http
    from mlxd.runtime import gc_pauses
    from mlxd.runtime.logging import get_logger
    from mlxd.runtime.supervisor import open_runtime

    log = get_logger("mlxd.serve")
    stopped = trio.Event()
    async with open_runtime(config) as rt, trio.open_nursery() as nursery:
        if args.record_trace is not None:
            record_trace(rt, args.record_trace)
        nursery.start_soon(_watch_signals, rt, stopped, args.shutdown_timeout, nursery.cancel_scope)
        nursery.start_soon(_watch_device, rt, stopped, args.shutdown_timeout)
        binds = await nursery.start(
            lambda task_status: serve_http(
                rt, host=args.host, port=args.port, shutdown_trigger=stopped.wait, task_status=task_status
            )
        )
        log.info("serve.listening", binds=binds, model=rt.info.model_name,
                 api_key=config.api_key is not None, admin_key=config.admin_key is not None)
        _warn_if_exposed(args.host, config)
        if isinstance(getattr(args, "ssd_cache_max", None), DiskShare) and config.ssd_cache_dir is not None:
            log.info("serve.ssd_cap", share=float(args.ssd_cache_max), max_bytes=config.ssd_cache_max_bytes,
                     dir=str(config.ssd_cache_dir))
        # Everything start-up made (the model, the imports, the probe's leftovers collected first): no full
        # collection walks it again while serving (runtime/gc_pauses.py; MLXD_GC_FREEZE=0 leaves it).
        frozen = gc_pauses.freeze_heap() if freeze else None
        if frozen is not None:
            log.info("serve.gc_frozen", **frozen)
        print(f"mlxd: serving {rt.info.model_name} on {' '.join(binds)}", file=sys.stderr, flush=True)
        try:
            await stopped.wait()
        finally:
            if frozen is not None:
                gc_pauses.thaw()  # a process that goes on (an in-process server) collects as before
        nursery.cancel_scope.cancel()
    return rt.engine.device_lost


def _warn_if_exposed(host: str, config) -> None:
    """A non-loopback bind without an API key lets anyone on the network in."""
    from mlxd.http.security import is_loopback
    from mlxd.runtime.logging import get_logger

    if not is_loopback(host) and config.api_key is None:
        get_logger("mlxd.serve").warning(
            "serve.unauthenticated", host=host,
            hint="anyone who can reach this address can use the API; set --api-key or MLXD_API_KEY",
        )


def record_trace(rt, path: Path) -> None:
    """Append each finished request and each flush to `path` (mlxd trace format), times from
    server start; the first line is the server's cache configuration, so `mlxd simulate FILE`
    replays this server with no other flags."""
    import time

    from mlxd.sim.trace import TraceRecorder

    recorder = TraceRecorder(path)
    start = time.monotonic()
    recorder.server(**server_record(rt))

    def observe(record) -> None:
        if record.reason in ("client_gone", "failed"):
            return
        recorder.record(
            t=round(record.submitted_at - start, 6),
            tokens=record.prompt,
            output_tokens=record.completion_tokens,
            namespace=record.namespace,
            session=record.session,
            cached_tokens=record.cached_tokens,
            cache_tier=record.cache_tier,
            output_ids=record.output_ids,
            ttft_s=record.ttft_s,
            queued_s=record.queued_s,
            kv_waited=record.kv_waited,
            parts={"lookup_s": record.lookup_s, "fetch_s": record.fetch_s, "read_s": record.read_s,
                   "land_s": record.land_s, "verify_s": record.verify_s},
            resident=record.resident,
        )

    def flushed(report: dict) -> None:
        began = time.monotonic() - float(report.get("seconds") or 0.0)
        # The restore advisor's online calibration at this point, so a replay decides
        # restore-or-recompute with the numbers this server used (read on the trio thread).
        advisor = rt.cache_owner.tiers.advisor
        calibration = {**advisor.calibration(), "always": advisor.always, "split": advisor.split,
                       "never": advisor.never, "overlap": advisor.overlap}
        recorder.flush(t=round(began - start, 6), restore_advisor=calibration)

    rt.scheduler.observers.append(observe)
    rt.flush_observers.append(flushed)


def _host_tier_in_effect() -> bool:
    from mlxd.runtime import host_memory

    return host_memory.separate_host_memory()


def server_record(rt) -> dict:
    """What a replay needs to know about this server's cache (the trace's first line)."""
    import attrs

    from mlxd.kv.blocks import span_for

    c = rt.config
    return {
        "model": rt.info.model_name,
        "kv_bytes_per_token": rt.info.kv_bytes_per_token,
        "prompt_cache_bytes": c.prompt_cache_bytes,
        # the host tier only where it was in effect (a no-op on unified memory)
        "host_cache_bytes": c.host_cache_bytes if _host_tier_in_effect() else 0,
        "retention": c.retention,
        "snapshot_min_tokens": c.snapshot_min_tokens,
        "max_batch": c.max_batch,
        "prefill_batch": c.prefill_batch,
        "prefill_step_size": c.prefill_step_size,
        "ssd": c.ssd_cache_dir is not None,
        "ssd_cache_max_bytes": c.ssd_cache_max_bytes,
        "ssd_demote_idle_s": c.ssd_demote_idle_s,
        "ssd_write_rate_bytes": c.ssd_write_rate_bytes,
        "ssd_layout": c.ssd_layout,
        "ssd_block_tokens": rt.ssd_block_tokens,
        "ram_pages": c.ram_pages,  # a model with other caches than attention KV kept contiguous entries
        "ram_page_tokens": c.ram_page_tokens or c.ssd_block_tokens or span_for(rt.info.kv_bytes_per_token),
        "restore_choice": c.restore_choice,  # measured, always, never, split or overlap: a replay decides alike
        "restore_overlap": c.overlaps_weighed,
        # --kv-admission: the rule and the room it had beside this runtime's own memory (a replay admits alike)
        "kv_admission": rt.scheduler.kv_admission.rule() if rt.scheduler.kv_admission is not None else None,
        # The cost model the restore advisor starts from: the startup probe's, when it ran
        # (without one the advisor starts from the default model, as a replay does).
        "restore_advisor_base": attrs.asdict(rt.info.probe.cost_model()) if rt.info.probe is not None else None,
    }


# The share of --shutdown-timeout kept for the SSD flush: draining stops when only this is left.
FLUSH_RESERVE = 0.25


async def _watch_signals(rt, stopped, grace_s: float, scope) -> None:
    """First SIGINT/SIGTERM: stop admission, drain, flush, exit. A second one: exit at once."""
    import trio

    from mlxd.runtime.logging import get_logger

    log = get_logger("mlxd.serve")
    # The receiver stays open until the process exits, so a late second signal is
    # a forced exit too, never a stray KeyboardInterrupt.
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async for signum in signals:
            log.info("serve.shutdown", signal=signal.Signals(signum).name, timeout_s=grace_s)
            rt.stop_admission()
            break
        async with trio.open_nursery() as nursery:

            async def second_signal() -> None:
                async for signum in signals:
                    log.warning("serve.forced_exit", signal=signal.Signals(signum).name)
                    scope.cancel()
                    return

            nursery.start_soon(second_signal)
            # Draining may use the budget less the flush's reserved share; the flush then has
            # the rest, so requests that never finish cannot leave it no time.
            await _drain_and_flush(rt, grace_s)
            stopped.set()  # hypercorn stops; the serve nursery is cancelled, and us with it


async def _drain_and_flush(rt, grace_s: float) -> None:
    """Drain admitted requests, then flush the SSD tier, within `grace_s` (the flush keeps its share of it)."""
    import trio

    from mlxd.runtime.logging import get_logger

    log = get_logger("mlxd.serve")
    start = trio.current_time()
    deadline = start + grace_s
    reserve = FLUSH_RESERVE * grace_s if rt.cold is not None else 0.0
    with trio.move_on_at(deadline - reserve) as drain_scope:
        await rt.drain()
    log.info("serve.drained", complete=not drain_scope.cancelled_caught,
             seconds=round(trio.current_time() - start, 3))
    if rt.cold is not None:
        with trio.move_on_at(deadline) as flush_scope:
            report = await rt.flush()
            log.info("serve.flushed", **report)
        if flush_scope.cancelled_caught:
            log.warning("serve.flush_incomplete", timeout_s=grace_s,
                        note="the flush did not finish within --shutdown-timeout; what was not "
                        "written is lost with this process")


async def _watch_device(rt, stopped, grace_s: float) -> None:
    """The engine lost its device (actors/engine.py `_reset_failed`): stop as on SIGTERM; `serve` exits 1."""
    from mlxd.runtime.logging import get_logger

    await rt.engine.lost.wait()
    get_logger("mlxd.serve").error("serve.device_lost", reason=rt.engine.device_lost,
                                   note="stopping: every request fails until this process is started again")
    await _drain_and_flush(rt, grace_s)
    stopped.set()


def add_build_model_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-model", help="build a built-in random-weight model directory")
    p.add_argument("--preset", default="default", choices=_preset_names(), metavar="PRESET",
                   help="the built-in random-weight model to build")
    p.add_argument("--out", type=Path, help="directory to write (default: the user cache dir)")
    p.add_argument("--seed", type=int, default=0)


def run_build_model(args: argparse.Namespace) -> int:
    from mlxd.model.tiny import build_model, ensure_model, stderr_progress

    if args.out is not None:
        path = build_model(args.out, args.preset, seed=args.seed, progress=stderr_progress)
    else:
        path = ensure_model(args.preset, seed=args.seed, progress=stderr_progress)
    print(path)
    return 0


def add_build_adapter_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("build-adapter", help="write a random LoRA adapter for a model, as mlx_lm.lora writes one "
                       "(to try --adapter offline)")
    p.add_argument("--model", required=True, help="the local model directory the adapter is for")
    p.add_argument("--out", type=Path, required=True, help="directory to write (adapter_config.json, adapters.safetensors)")
    p.add_argument("--rank", type=int, default=8, help="the rank of each layer's A and B")
    p.add_argument("--scale", type=float, default=4.0, help="lora_parameters.scale")
    p.add_argument("--num-layers", type=int, default=-1, help="the last N blocks (-1: all, as mlx-lm)")
    p.add_argument("--keys", nargs="+", metavar="KEY", help="module names within a block, e.g. self_attn.q_proj "
                   "(default: every linear layer)")
    p.add_argument("--seed", type=int, default=0, help="random seed of A and B")


def run_build_adapter(args: argparse.Namespace) -> int:
    from mlxd.model.lora import build_adapter

    print(build_adapter(args.model, args.out, seed=args.seed, rank=args.rank, scale=args.scale,
                        num_layers=args.num_layers, keys=args.keys))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="mlxd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    add_serve_parser(sub)
    add_build_model_parser(sub)
    add_build_adapter_parser(sub)
    from mlxd.sim.flags import add_simulate_parser

    add_simulate_parser(sub)
    return parser


def main(argv: list[str] | None = None, *, exit_at_once: bool = True) -> int:
    """`exit_at_once`: a served process that stopped cleanly ends as soon as its runtime has closed
    (`_exit_at_once`); a caller with more to do after `main` returns (a profiler's report) passes False."""
    args = build_parser().parse_args(argv)
    if args.command == "serve":
        faulthandler.enable()  # a native crash (MLX, a library's threads) leaves every thread's stack on stderr
        if hasattr(signal, "SIGUSR1"):  # and SIGUSR1 dumps them without stopping (a hung server, tests' post-mortem)
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        code = run_serve(args)
        if exit_at_once and code in (0, 1):  # 1: stopped after its device failed (its teardown could touch it)
            _exit_at_once(code)
        return code
    if args.command == "build-model":
        return run_build_model(args)
    if args.command == "build-adapter":
        return run_build_adapter(args)
    if args.command == "simulate":
        from mlxd.sim.cli import run_simulate

        return run_simulate(args)
    return 2


def _exit_at_once(code: int) -> NoReturn:
    """End the process now: the runtime has closed, so every flushed checkpoint is durable and every file
    closed. The atexit handlers still run (logging's flush, finalizers such as the SSD directory lock's
    note); the interpreter's teardown is skipped: it freed the model, the caches and (CUDA) page-locked host
    memory one object at a time, 1-2.5 s between the last write and the exit (issue 28, the SIGTERM flush)."""
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())

"""A chat request with images: its prompt key and ImageInputs, or a 400 that says why."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import trio

from mlxd.http.schemas import ApiError
from mlxd.vision.images import ImageLimits, ImageRejected
from mlxd.vision.prepare import MediaPreparer, image_refs

if TYPE_CHECKING:

    from mlxd.runtime.kernel.messages import SamplingParams
    from mlxd.runtime.supervisor import Runtime


def preparer_for(rt: Runtime) -> MediaPreparer | None:
    """The server's image preparer (None: a text-only model)."""
    from pathlib import Path

    c = rt.config
    limits = ImageLimits(max_bytes=c.max_image_bytes, max_images=c.max_images,
                         allow_dir=Path(c.allow_media_dir) if c.allow_media_dir is not None else None)
    return MediaPreparer.for_model(Path(rt.info.model_path), limits=limits, ssd_dir=c.ssd_cache_dir)


async def chat_prompt(
    rt: Runtime,
    preparer: MediaPreparer | None,
    messages: Sequence[dict[str, Any]],
    sampling: SamplingParams,
    render: Any,
    *,
    names: Sequence[str] | None = None,
) -> tuple[tuple[int, ...], tuple[Any, ...], tuple[int, ...]]:
    """(prompt key, media, checkpoint cuts) of a chat: `render(realign)` renders it, (ids, template cut or
    None); with no image, media is (); with images, no cut (their rows prefill whole). `names`: each
    message's field in the request's body, for an image's error (`image_refs`)."""
    try:
        refs = image_refs(messages, names)
    except ImageRejected as exc:
        raise ApiError(400, str(exc), param="messages") from None
    if not refs:
        ids, cut = await render(True)
        return ids, (), (() if cut is None else (cut,))
    if preparer is None:
        raise ApiError(400, f"the model '{rt.info.model_name}' does not read images: serve a vision model "
                       "(e.g. --preset test-vlm)", param="messages", code="unsupported_content")
    if rt.config.distributed:
        raise ApiError(400, "images are not served with --distributed yet", param="messages",
                       code="unsupported_content")
    if sampling.presence_penalty or sampling.frequency_penalty or sampling.repetition_penalty not in (None, 1.0):
        raise ApiError(400, "penalties (presence, frequency, repetition) are not supported with images yet",
                       param="messages", code="unsupported_parameter")
    try:
        # A follow-up's images are all known: no thread hop (on a busy host one costs milliseconds).
        prepared = preparer.known(refs)
        if prepared is None:
            prepared = await trio.to_thread.run_sync(preparer.prepare, refs)
        ids, _ = await render(False)
        return *preparer.widen(ids, prepared), ()
    except ImageRejected as exc:
        raise ApiError(400, str(exc), param="messages", code="invalid_image") from None




"""mlxd: an async, actor-based LLM serving runtime on MLX with a durable tiered prompt cache.

Embed it in a trio program:

    import mlxd

    async with mlxd.open_runtime(mlxd.RuntimeConfig()) as rt:
        request = rt.request(await rt.render_chat([{"role": "user", "content": "Hi"}]))
        async with rt.submit(request) as stream:
            async for event in stream:
                ...

or start it as a service in a nursery you already have:

    rt = await nursery.start(mlxd.serve_runtime, mlxd.RuntimeConfig())
"""

from mlxd import _blas

_blas.preload()  # before anything imports mlx

from mlxd.runtime.config import RuntimeConfig  # noqa: E402
from mlxd.runtime.kernel.messages import (  # noqa: E402
    GenerationFailed,
    GenerationFinished,
    GenerationRequest,
    PromptAccepted,
    SamplingParams,
    TokenGenerated,
)
from mlxd.runtime.supervisor import (  # noqa: E402
    GenerationError,
    GenerationStream,
    InvalidRequest,
    QueueFull,
    Runtime,
    ShuttingDown,
    open_runtime,
    serve_runtime,
)

__version__ = "0.1.0"

__all__ = [
    "GenerationError",
    "GenerationFailed",
    "GenerationFinished",
    "GenerationRequest",
    "GenerationStream",
    "InvalidRequest",
    "PromptAccepted",
    "QueueFull",
    "Runtime",
    "RuntimeConfig",
    "SamplingParams",
    "ShuttingDown",
    "TokenGenerated",
    "__version__",
    "open_runtime",
    "serve_runtime",
]

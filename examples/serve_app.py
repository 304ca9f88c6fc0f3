"""A Ray Serve app that owns a TP=2 deployment and answers HTTP JSON requests of token ids.

The replica reserves its ranks' bundles with ``placement_group_bundles`` (the replica
itself takes no CPU in bundle 0), and ``Deployment.launch`` reuses that placement group.

    serve run examples.serve_app:app         # or: python examples/serve_app.py
    curl -X POST http://127.0.0.1:8000/ -d '{"tokens": [1, 2, 3, 4], "max_new_tokens": 8}'

Body: ``{"tokens": [int, ...], "max_new_tokens": int (default 16), "rid": str (optional)}``,
decoded strictly (no coercion: ``"1234"``, ``1.9``, ``true`` or a dict are refused), at most
``MAX_BODY_BYTES``. Answer: a ``RequestResult`` as JSON (``rid``, ``output_tokens``,
``device_hit_tokens``, ...); ``{"error": ...}`` with status 400 for a bad body or request,
413 for a body over the limit, 503 when the deployment cannot serve. The ``rid`` is made
here unless the client sends a valid one.
"""

from __future__ import annotations

import itertools
import os
from typing import Any

import msgspec
from ray import serve
from starlette.requests import Request
from starlette.responses import JSONResponse

from actors import Deployment, DeploymentConfig
from actors.http_body import read_body
from actors.lifecycle import DeploymentError
from actors.stores import drop_store
from hicache_ray.base.config import CacheConfig, MemoryConfig
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.engine.model import preset
from hicache_ray.engine.request import GenerateRequest

TP = 2
MAX_BODY_BYTES = 1 << 20


class Body(msgspec.Struct, forbid_unknown_fields=True):
    """The HTTP request body (decoded strictly)."""

    tokens: list[int]
    max_new_tokens: int = 16
    rid: str | None = None


def decode_body(data: bytes) -> Body | str:
    """The body, or why it is not a valid one."""
    try:
        return msgspec.json.decode(data, type=Body)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        return f"bad request body: {exc}"
    except RecursionError:
        return "bad request body: JSON nested too deeply"


def _error(status: int, message: str) -> JSONResponse:
    return JSONResponse({"error": message}, status_code=status)


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    placement_group_bundles=[{"CPU": 1.0}] * TP,
    placement_group_strategy="STRICT_PACK",
)
class CacheApp:
    """One replica, its deployment and its L3 store (dropped when the app shuts down,
    unless ``keep_store``: other apps naming the same store share it meanwhile)."""

    def __init__(
        self, model: str = "tiny4", store: str = "serve", keep_store: bool = False
    ) -> None:
        self.store, self.keep_store = store, keep_store
        cache = CacheConfig(
            memory=MemoryConfig(page_size=16, device_tokens=4096),
            storage=StorageConfig(
                backend="ray",
                model_id=model,
                share_tp=(1, 2, 4),
                ray=RayStorageOptions(name=store),
            ),
        )
        config = DeploymentConfig(
            name=f"serve-{os.getpid()}", model=preset(model), tp_size=TP, cache=cache
        )
        self.deployment = Deployment.launch(config)
        self._ids = itertools.count()

    async def __call__(self, request: Request) -> Any:
        data = await read_body(request, MAX_BODY_BYTES)
        if data is None:
            return _error(413, f"request body over {MAX_BODY_BYTES} bytes")
        body = decode_body(data)
        if isinstance(body, str):
            return _error(400, body)
        rid = body.rid if body.rid is not None else f"http-{os.getpid()}-{next(self._ids)}"
        try:
            result = await self.deployment.generate_async(
                GenerateRequest(rid, body.tokens, body.max_new_tokens)
            )
        except DeploymentError as exc:
            return _error(503, str(exc))
        status = 400 if result.error else 200
        return JSONResponse(msgspec.to_builtins(result), status_code=status)

    def stats(self) -> dict[str, Any]:
        return msgspec.to_builtins(self.deployment.stats())

    def __del__(self) -> None:
        self.deployment.shutdown()
        if not self.keep_store:
            drop_store(self.store)


app = CacheApp.bind()

if __name__ == "__main__":
    import time

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(app)
    print("serving on http://127.0.0.1:8000/ (Ctrl-C stops)")
    while True:
        time.sleep(3600)

"""A Ray Serve app that owns a TP=2 deployment and answers HTTP JSON requests.

The replica reserves its ranks' bundles with ``placement_group_bundles`` (the replica
itself takes no CPU in bundle 0), and ``Deployment.launch`` reuses that placement group.

    serve run examples.serve_app:app         # or: python examples/serve_app.py
    curl -X POST http://127.0.0.1:8000/ -d '{"tokens": [1, 2, 3, 4], "max_new_tokens": 8}'

Answer: ``{"rid", "output_tokens", "device_hit_tokens", "host_hit_tokens",
"storage_hit_tokens", "recomputed_tokens", "ttft_s", ...}`` (a ``RequestResult``), or
``{"error": ...}`` with status 400 for a bad request.
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
from hicache_ray.config import CacheConfig, MemoryConfig, RayStorageOptions, StorageConfig
from hicache_ray.model import preset
from hicache_ray.runtime import GenerateRequest

TP = 2


@serve.deployment(
    ray_actor_options={"num_cpus": 0},
    placement_group_bundles=[{"CPU": 1.0}] * TP,
    placement_group_strategy="STRICT_PACK",
)
class CacheApp:
    def __init__(self, model: str = "tiny4", store: str = "serve") -> None:
        cache = CacheConfig(
            memory=MemoryConfig(page_size=16, device_tokens=4096),
            storage=StorageConfig(
                backend="ray",
                model_id=model,
                tp_lcm_size=4,
                head_group=1,
                ray=RayStorageOptions(name=store),
            ),
        )
        config = DeploymentConfig(
            name=f"serve-{os.getpid()}", model=preset(model), tp_size=TP, cache=cache
        )
        self.deployment = Deployment.launch(config)
        self._ids = itertools.count()

    async def __call__(self, request: Request) -> Any:
        try:
            body = await request.json()
            tokens = [int(t) for t in body["tokens"]]
            max_new = int(body.get("max_new_tokens", 16))
        except (ValueError, KeyError, TypeError) as exc:
            return JSONResponse({"error": f"bad request body: {exc!r}"}, status_code=400)
        rid = body.get("rid") or f"http-{os.getpid()}-{next(self._ids)}"
        result = await self.deployment.generate_async(GenerateRequest(rid, tokens, max_new))
        status = 400 if result.error else 200
        return JSONResponse(msgspec.to_builtins(result), status_code=status)

    def stats(self) -> dict[str, Any]:
        return self.deployment.stats()

    def __del__(self) -> None:
        self.deployment.shutdown()


app = CacheApp.bind()

if __name__ == "__main__":
    import time

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    serve.start(http_options={"host": "127.0.0.1", "port": 8000})
    serve.run(app)
    print("serving on http://127.0.0.1:8000/ (Ctrl-C stops)")
    while True:
        time.sleep(3600)

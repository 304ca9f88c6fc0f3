"""Heterogeneous TP: a TP=2 and a TP=4 deployment of one model share an L3 namespace.

Conversations start on TP=2; their next turns go to TP=4, which starts with empty pools
and finds the history in L3 (the Ray object store): pages are named by what they hold
(unified keys, ``share_tp=(2, 4)``), so a TP=2 rank's objects are exactly two TP=4 ranks'.

On a real cluster, give the nodes of each deployment a custom resource and pass it:

    ray start --head --resources '{"tp2_pool": 8}'            # on the TP=2 nodes
    ray start --address HEAD:6379 --resources '{"tp4_pool": 8}'  # on the TP=4 nodes
    python examples/hetero_tp.py --address auto --tp2-resource tp2_pool --tp4-resource tp4_pool \\
        --gpus-per-rank 1

Without flags it runs on an embedded local Ray (CPU). Add ``--model bench`` for a larger model.
"""

from __future__ import annotations

import argparse
import os

import ray
import torch

from actors import Deployment, DeploymentConfig, drop_store
from hicache_ray.base.config import CacheConfig, MemoryConfig, PrefetchConfig
from hicache_ray.base.storage_config import RayStorageOptions, StorageConfig
from hicache_ray.engine.model import preset
from hicache_ray.engine.reference import recompute
from hicache_ray.engine.request import GenerateRequest


def _args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--address", default="local", help="Ray address (default: embedded)")
    parser.add_argument("--model", default="tiny4", help="reference model preset")
    parser.add_argument("--tp2-resource", help="custom resource of the TP=2 nodes")
    parser.add_argument("--tp4-resource", help="custom resource of the TP=4 nodes")
    parser.add_argument("--gpus-per-rank", type=int, default=0)
    parser.add_argument("--clients", type=int, default=4)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> dict[str, int]:
    args = _args(argv)

    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    started = not ray.is_initialized()
    if started:
        ray.init(address=args.address, **({"num_cpus": 6} if args.address == "local" else {}))
    model = preset(args.model)
    store = RayStorageOptions(name=f"hetero-{os.getpid()}")
    cache = CacheConfig(
        memory=MemoryConfig(page_size=16, device_tokens=2048),
        prefetch=PrefetchConfig(policy="wait_complete", threshold_tokens=0),
        storage=StorageConfig(backend="ray", model_id=model.name, share_tp=(2, 4), ray=store),
    )

    def launch(tp: int, resource: str | None) -> Deployment:
        extra = {resource: 0.01} if resource else {}
        return Deployment.launch(
            DeploymentConfig(
                name=f"hetero-tp{tp}",
                model=model,
                tp_size=tp,
                cache=cache,
                gpus_per_rank=args.gpus_per_rank,
                bundle_resources=extra,
            )
        )

    tp2, tp4 = launch(2, args.tp2_resource), launch(4, args.tp4_resource)
    gen = torch.Generator().manual_seed(0)
    totals = {"requests": 0, "tp4_l3_hit_tokens": 0, "wrong": 0}
    try:
        prompts = [
            torch.randint(0, model.vocab_size, (96,), generator=gen).tolist()
            for _ in range(args.clients)
        ]
        first = tp2.generate([GenerateRequest(f"c{i}-t0", p, 16) for i, p in enumerate(prompts)])
        tp2.wait_idle()  # the first turns are in L3
        follow = [p + r.output_tokens + [1, 2, 3, 4] for p, r in zip(prompts, first, strict=True)]
        second = tp4.generate([GenerateRequest(f"c{i}-t1", p, 16) for i, p in enumerate(follow)])
        for prompt, result in zip(follow, second, strict=True):
            totals["requests"] += 1
            totals["tp4_l3_hit_tokens"] += result.storage_hit_tokens
            totals["wrong"] += result.output_tokens != recompute(model, prompt, 16)
            print(
                f"{result.rid}: {len(prompt)} prompt tokens on TP=4, {result.storage_hit_tokens} "
                f"from L3, {result.device_hit_tokens} from L1, TTFT {result.ttft_s * 1e3:.0f} ms"
            )
        same = totals["requests"] - totals["wrong"]
        print(f"TP=4 answers equal to recompute: {same} of {totals['requests']}")
    finally:
        tp2.shutdown()
        tp4.shutdown()
        drop_store(store.name)
        if started:
            ray.shutdown()
    return totals


if __name__ == "__main__":
    main()

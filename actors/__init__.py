"""The Ray layer (thin hosts of the library): the object-store L3, rank actors, Deployment,
the Serve app."""

from actors.ray_store import RayObjects
from actors.shards import NAMESPACE
from actors.stores import StoreInfo, clear_store, drop_store, list_stores, store_stats
from hicache_ray.engine.spec import DeploymentConfig

__all__ = [
    "NAMESPACE",
    "Deployment",
    "DeploymentConfig",
    "DeploymentError",
    "RankFailure",
    "RayObjects",
    "StoreInfo",
    "clear_store",
    "drop_store",
    "list_stores",
    "store_stats",
]


def __getattr__(name: str) -> object:
    # The deployment pulls in the rank actor (and torch models); load it on first use.
    if name in ("Deployment", "DeploymentError"):
        from actors import deployment

        return getattr(deployment, name)
    if name == "RankFailure":
        from actors.rank import RankFailure

        return RankFailure
    raise AttributeError(name)

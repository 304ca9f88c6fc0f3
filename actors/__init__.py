"""Ray actors (thin wrappers over the core): the object-store L3, rank actors, Deployment.

Importing this package registers the ``ray`` storage backend.
"""

from actors.ray_store import NAMESPACE, RayObjects, clear_store, store_stats
from actors.spec import DeploymentConfig

__all__ = [
    "NAMESPACE",
    "Deployment",
    "DeploymentConfig",
    "DeploymentError",
    "RankFailure",
    "RayObjects",
    "clear_store",
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

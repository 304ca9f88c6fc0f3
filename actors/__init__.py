"""Ray actors (thin wrappers over the core): the object-store L3, rank actors, Deployment.

Importing this package registers the ``ray`` storage backend.
"""

from actors.ray_store import NAMESPACE, RayObjects, clear_store, store_stats

__all__ = ["NAMESPACE", "RayObjects", "clear_store", "store_stats"]

"""L3 storage: the batched interface, the page object format, backends and fault injection."""

from hicache_ray.base.backends import backend_names, register_backend
from hicache_ray.storage.base import PreparedRead, StorageBackend, StorageStats
from hicache_ray.storage.faults import FaultyObjects, InjectedFault
from hicache_ray.storage.file_objects import FileObjects
from hicache_ray.storage.objects import MemoryObjects, ObjectStore
from hicache_ray.storage.page_format import CorruptPage, PageHeader
from hicache_ray.storage.paged import PagedBackend
from hicache_ray.storage.registry import NullBackend, create_backend

__all__ = [
    "CorruptPage",
    "FaultyObjects",
    "FileObjects",
    "InjectedFault",
    "MemoryObjects",
    "NullBackend",
    "ObjectStore",
    "PageHeader",
    "PagedBackend",
    "PreparedRead",
    "StorageBackend",
    "StorageStats",
    "backend_names",
    "create_backend",
    "register_backend",
]

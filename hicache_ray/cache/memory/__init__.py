"""L1 and L2 memory: page allocator, device pool, host pool, host budget, transfers."""

from hicache_ray.cache.memory.allocator import PageAllocator
from hicache_ray.cache.memory.budget import host_memory_budget
from hicache_ray.cache.memory.device_pool import DevicePool, default_device
from hicache_ray.cache.memory.host_pool import HostPool
from hicache_ray.cache.memory.transfer import Transfer, TransferEngine, page_runs

__all__ = [
    "DevicePool",
    "HostPool",
    "PageAllocator",
    "Transfer",
    "TransferEngine",
    "default_device",
    "host_memory_budget",
    "page_runs",
]

"""``hicache-ray bench micro``: L1<->L2 transfer bandwidth per layout and tree throughput.

Transfers copy a scattered set of whole pages (random host and device page ids, the worst
case for coalescing) and are timed against a plain contiguous ``copy_`` of the same number
of bytes measured in the same run, interleaved with them so machine noise hits both alike.
The tree is timed on the shared-prefix workload with keys already encoded (the runtime
encodes a prompt once, at admission, and reuses the key for every tree walk and insert of
the request); ``tree.request_per_s.with_encoding`` adds that one encoding per request.
"""

from __future__ import annotations

import gc
import random
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch

from apps.bench.tree_sglang import sglang_tree_figures
from apps.bench.workload import shared_prefix_requests
from apps.report import Figure, figure, fp16_kv, time_into
from hicache_ray.base.tokens import encode_tokens
from hicache_ray.cache.memory import DevicePool, HostPool, PageAllocator, Transfer, TransferEngine
from hicache_ray.cache.tree import HiRadixTree

__all__ = ["MicroOptions", "run_micro"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct")


@dataclass(frozen=True)
class MicroOptions:
    num_layers: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    page_size: int = 64
    pages_per_transfer: int = 32
    repeats: int = 9
    num_requests: int = 2000
    num_prefixes: int = 64
    prefix_len: int = 1024
    suffix_len: int = 256
    large_requests: int = 4000
    quick: bool = False

    @classmethod
    def quick_options(cls) -> MicroOptions:
        return cls(
            quick=True,
            num_layers=4,
            num_kv_heads=2,
            head_dim=32,
            pages_per_transfer=8,
            repeats=3,
            num_requests=200,
            num_prefixes=8,
            large_requests=300,
        )


def _round_trip(
    submit: Callable[[list[int], list[int]], Transfer], a: list[int], b: list[int]
) -> None:
    submit(a, b).wait()


def transfer_figures(
    opts: MicroOptions, device: torch.device, log: Callable[[str], None]
) -> list[Figure]:
    kv = fp16_kv(opts.num_layers, opts.num_kv_heads, opts.head_dim, opts.page_size)
    n = opts.pages_per_transfer
    nbytes = n * kv.page_bytes
    dev = DevicePool(kv, 3 * n, device)
    for slot in dev.buffers:
        for t in slot:
            t.fill_(1.0)
    src = torch.full((nbytes,), 3, dtype=torch.uint8, device=device)  # touched, not zero pages
    dst = torch.ones_like(src)
    rnd = random.Random(0)
    figures: list[Figure] = []
    for layout in LAYOUTS:
        log(f"transfer: {layout} ({nbytes / 2**20:.0f} MiB per transfer)")
        host = HostPool(kv, 6 * n, layout, layer_granule=8)  # type: ignore[arg-type]
        host.buffers[0].fill_(2.0)
        for b in host.buffers[1:]:
            b.fill_(2.0)
        ceiling: list[float] = []
        load: list[float] = []
        write: list[float] = []
        with TransferEngine(dev, host) as engine:
            for rep in range(opts.repeats + 1):
                host_pages = rnd.sample(range(host.num_pages), n)
                dev_pages = rnd.sample(range(dev.num_pages), n)
                samples = (ceiling, load, write) if rep else ([], [], [])  # rep 0 warms up

                def copy() -> None:
                    dst.copy_(src)
                    if device.type == "cuda":
                        torch.cuda.synchronize()

                time_into(copy, samples[0])
                time_into(partial(_round_trip, engine.load, host_pages, dev_pages), samples[1])
                time_into(partial(_round_trip, engine.write, dev_pages, host_pages), samples[2])
        ceil_gbps = nbytes / statistics.median(ceiling) / 1e9
        for name, times in (("load", load), ("write", write)):
            gbps = nbytes / statistics.median(times) / 1e9
            figures.append(
                figure(
                    f"transfer.{name}.{layout}.gbps", gbps, "GB/s", ceiling=ceil_gbps, target=0.8
                )
            )
        del host
    return figures


def _tree_run(
    requests: list[bytes], page_size: int, prefix: str, targets: dict[str, float]
) -> list[Figure]:
    tree = HiRadixTree(page_size)
    pages_per_request = len(requests[0]) // 4 // page_size
    alloc = PageAllocator(len(requests) * pages_per_request + 1)
    insert_s = 0.0
    for key in requests:
        m = tree.match_prefix(key)
        got = alloc.allocate(pages_per_request - len(m.device_pages))
        assert got is not None
        pages = m.device_pages + got
        start = time.perf_counter()
        result = tree.insert(key, pages)
        insert_s += time.perf_counter() - start
        alloc.free(result.duplicate_pages)
    start = time.perf_counter()
    for key in requests:
        tree.match_prefix(key)
    match_s = time.perf_counter() - start
    tokens = tree.num_device_pages * page_size
    start = time.perf_counter()
    tree.evict_device(tree.num_device_pages)
    evict_s = time.perf_counter() - start
    assert tree.num_nodes == 0
    n = len(requests)
    return [
        figure(f"{prefix}.insert_per_s", n / insert_s, "1/s", target=targets.get("insert")),
        figure(f"{prefix}.match_per_s", n / match_s, "1/s", target=targets.get("match")),
        figure(f"{prefix}.evict_all_s", evict_s, "s", better="lower"),
        figure(f"{prefix}.tokens", float(tokens), "tokens"),
    ]


def tree_figures(opts: MicroOptions, log: Callable[[str], None]) -> list[Figure]:
    log(f"tree: {opts.num_requests} requests of {opts.prefix_len}+{opts.suffix_len} tokens")
    lists = shared_prefix_requests(
        opts.num_requests, opts.num_prefixes, opts.prefix_len, opts.suffix_len
    )
    start = time.perf_counter()
    keys = [encode_tokens(r) for r in lists]
    encode_s = time.perf_counter() - start
    # The token lists are 2.5 M young Python ints in lists the garbage collector would scan
    # again and again while the tree allocates nodes (4-20x slower inserts here); a server
    # keeps encoded keys, so the lists are dropped before timing.
    del lists
    gc.collect()
    figures = _tree_run(keys, opts.page_size, "tree", {"insert": 20000, "match": 50000})
    n = len(keys)
    rate = {f.name: f.value for f in figures}
    walk_s = n / rate["tree.insert_per_s"] + n / rate["tree.match_per_s"]
    figures += [
        figure("tree.encode_per_s", n / encode_s, "1/s"),
        figure("tree.request_per_s", n / walk_s, "1/s"),
        figure("tree.request_per_s.with_encoding", n / (walk_s + encode_s), "1/s"),
    ]
    figures += sglang_tree_figures(keys, opts.page_size, figures, log)
    log(f"tree: {opts.large_requests} requests (a tree of over a million tokens at full size)")
    large = shared_prefix_requests(
        opts.large_requests, opts.num_prefixes, opts.prefix_len, opts.suffix_len, seed=1
    )
    large_keys = [encode_tokens(r) for r in large]
    del large
    gc.collect()
    figures += _tree_run(large_keys, opts.page_size, "tree.large", {})
    return figures


def run_micro(
    opts: MicroOptions, device: torch.device, log: Callable[[str], None] = print
) -> list[Figure]:
    from apps.bench.consensus import ConsensusOptions, consensus_figures, fetch_figures

    copts = ConsensusOptions.quick() if opts.quick else ConsensusOptions()
    return (
        transfer_figures(opts, device, log)
        + tree_figures(opts, log)
        + consensus_figures(copts, log)
        + fetch_figures(copts, device, log)
    )

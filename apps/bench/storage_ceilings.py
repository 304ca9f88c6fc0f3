"""The ceilings of ``bench storage``: the same bytes moved without a backend (raw pyarrow
files, plain copies, ``ray.put`` / ``ray.get`` of the same objects), and the Ray set-up the
``ray`` runs need."""

from __future__ import annotations

from typing import Any

import numpy as np

from hicache_ray.storage.file_objects import open_filesystem

__all__ = ["RawFiles", "RawMemory", "RawRay", "ensure_ray", "warm_object_store"]


class RawFiles:
    """The ceiling: plain pyarrow files of the same payloads."""

    def __init__(self, root: str) -> None:
        self.fs, base = open_filesystem(root)
        self.base = f"{base}/raw-ceiling"
        self.fs.create_dir(self.base, recursive=True)

    def write(self, names: list[str], payloads: list[memoryview]) -> None:
        for name, payload in zip(names, payloads, strict=True):
            with self.fs.open_output_stream(f"{self.base}/{name}") as out:
                out.write(payload)

    def read(self, names: list[str], outs: list[memoryview]) -> None:
        for name, out in zip(names, outs, strict=True):
            with self.fs.open_input_file(f"{self.base}/{name}") as f:
                f.readinto(out)

    def clear(self) -> None:
        self.fs.delete_dir_contents(self.base, missing_dir_ok=True)


class RawMemory:
    """The ceiling of the memory backend: one copy of the same bytes in, one out."""

    def __init__(self) -> None:
        self.stored: dict[str, np.ndarray] = {}

    def write(self, names: list[str], payloads: list[memoryview]) -> None:
        for name, payload in zip(names, payloads, strict=True):
            self.stored[name] = np.frombuffer(payload, dtype=np.uint8).copy()

    def read(self, names: list[str], outs: list[memoryview]) -> None:
        for name, out in zip(names, outs, strict=True):
            np.copyto(np.frombuffer(out, dtype=np.uint8), self.stored[name])

    def clear(self) -> None:
        self.stored.clear()


class RawRay:
    """The ceiling of the ray backend: the same payloads in objects of the same size.

    ``write`` is ``ray.put`` in this process. ``read`` is ``ray.get`` plus a one-thread
    copy of objects another process put (any L3 read crosses processes: mapping another
    process's fresh object costs page faults that re-reading one's own does not), made
    before the timed read by a helper actor that owns them.
    """

    def __init__(self, object_bytes: int) -> None:
        import ray

        self.ray = ray
        self.object_bytes = object_bytes
        self.stored: dict[str, tuple[object, int]] = {}
        self.mine: list[object] = []
        self.helper: Any = ray.remote(num_cpus=0)(_ForeignPuts).remote()

    def _groups(self, payloads: list[memoryview]) -> list[list[int]]:
        groups: list[list[int]] = [[]]
        for i, payload in enumerate(payloads):
            size = sum(payloads[j].nbytes for j in groups[-1])
            if groups[-1] and size + payload.nbytes > self.object_bytes:
                groups.append([])
            groups[-1].append(i)
        return groups

    def write(self, names: list[str], payloads: list[memoryview]) -> None:
        for group in self._groups(payloads):
            self.mine.append(
                self.ray.put([np.frombuffer(payloads[j], dtype=np.uint8) for j in group])
            )

    def stage(self, names: list[str], payloads: list[memoryview]) -> None:
        """Objects of the same payloads put by the helper (untimed)."""
        groups = self._groups(payloads)
        arrays = [[np.frombuffer(payloads[j], dtype=np.uint8) for j in g] for g in groups]
        refs = self.ray.get(self.helper.put.remote(arrays))[0]
        for group, ref in zip(groups, refs, strict=True):
            self.stored.update((names[j], (ref, k)) for k, j in enumerate(group))

    def read(self, names: list[str], outs: list[memoryview]) -> None:
        for payload, out in zip(self.fetch(names), outs, strict=True):
            np.copyto(np.frombuffer(out, dtype=np.uint8), payload)

    def fetch(self, names: list[str]) -> list[np.ndarray]:
        """The staged payloads of ``names`` (``ray.get`` of their objects, zero-copy)."""
        refs = list({id(self.stored[n][0]): self.stored[n][0] for n in names}.values())
        objects: dict[int, list[np.ndarray]] = dict(
            zip(map(id, refs), self.ray.get(refs), strict=True)  # type: ignore[arg-type]
        )
        return [objects[id(self.stored[n][0])][self.stored[n][1]] for n in names]

    def clear(self) -> None:
        self.stored.clear()
        self.mine.clear()
        self.ray.get(self.helper.clear.remote())


class _ForeignPuts:
    """The helper actor of :class:`RawRay`: puts (and so owns) objects for the driver."""

    def __init__(self) -> None:
        self.refs: list[object] = []

    def put(self, groups: list[list[np.ndarray]]) -> list[list[object]]:
        import ray

        self.refs = [ray.put(group) for group in groups]
        return [self.refs]  # nested: the driver gets the references, not the values

    def clear(self) -> None:
        self.refs = []


def warm_object_store(nbytes: int) -> None:
    """Put and free ``nbytes`` once before timing: a fresh node's shared memory costs a page
    fault per page on first touch (a one-time cost of the node, not of a put), and whichever
    run touched it first would pay for both."""
    import ray

    chunk = np.ones(32 << 20, dtype=np.uint8)
    refs = [ray.put(chunk) for _ in range(max(1, nbytes // chunk.nbytes))]
    del refs


def ensure_ray() -> bool:
    """Start a local Ray for the ``ray`` backend if none is running (returns whether this
    call started it)."""
    import ray

    if ray.is_initialized():
        return False
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    return True

"""hicache-ray's L3 as a vLLM KV connector (vLLM 0.32, ``KVConnectorBase_V1``).

Launch vLLM with::

    --kv-transfer-config '{"kv_connector": "HiCacheRayConnector",
        "kv_connector_module_path": "hicache_ray.integrations.vllm", "kv_role": "kv_both",
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"store": "ray", "ray": {"name": "default"}}}'

A vLLM block is a page. Pages are named as hicache-ray and SGLang name them (chained
SHA-256 of the token ids, then the unified key of each (layer chunk, head group) object), so
one prefix of one model is one set of objects whichever engine or TP size wrote it. vLLM's
own block hashes are never used: they are seeded per process.

The scheduler side looks up the leading pages past vLLM's own hit and tells vLLM how many
tokens it can load: asynchronously by default (vLLM runs other requests meanwhile and
schedules this one once :meth:`HiCacheRayConnector.get_finished` reports its load), or
in the step that needs them (``load_async: false``: placed layer by layer as the forward
reaches each layer); each step it plans the loads
and the saves of the pages that step fills. The worker side reads and verifies each page
into staging and places it in vLLM's blocks (a reorder and an indexed copy per layer), and
after the forward gathers the filled blocks into staging and stores them on a background
thread. In-step loads are placed layer by layer while the forward runs (each layer's
attention waits for its own layer). A page that is missing, corrupt or unreadable is a load
error: vLLM recomputes its blocks (``kv_load_failure_policy: recompute``); a dead store is a
miss. Options: :class:`~hicache_ray.integrations.vllm.setup.VLLMStoreOptions`.
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
from vllm.distributed.kv_events import MEDIUM_STORAGE, BlockStored
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from hicache_ray.base.errors import ConfigError
from hicache_ray.base.stats import ConnectorStats
from hicache_ray.integrations.vllm.blocks import BlockMover, LayerByLayer
from hicache_ray.integrations.vllm.metrics import WORKER_FIELDS, ConnectorProm, MovedTokens
from hicache_ray.integrations.vllm.pages import PageJob, PagePlanner, SaveAcks, StepPlan
from hicache_ray.integrations.vllm.saved import SavedPages
from hicache_ray.integrations.vllm.setup import (
    VLLMStoreOptions,
    layer_index,
    model_kv,
    parse_options,
    rank_plan,
    storage_config,
    tp_suffixes,
)
from hicache_ray.storage.registry import connect

__all__ = ["HiCacheRayConnector", "HiCacheRayMeta"]

log = logging.getLogger(__name__)


class HiCacheRayMeta(KVConnectorMetadata):  # type: ignore[misc]  # vllm has no types here
    """One step's loads and saves, from the scheduler side to the workers."""

    def __init__(self, plan: StepPlan) -> None:
        self.plan = plan


def _tp_rank() -> int:
    try:
        from vllm.distributed.parallel_state import get_tensor_model_parallel_rank

        return int(get_tensor_model_parallel_rank())
    except (AssertionError, ImportError, RuntimeError):  # no TP group: a single rank
        return 0


def _shareable(request: Any) -> bool:
    """Whether a request's KV is named by its token ids alone: not when images or other
    media stand behind placeholder tokens, a LoRA adapter changes the KV, or the prompt
    comes as embeddings (such requests are neither looked up nor saved)."""
    return bool(
        request.prompt_token_ids
        and not getattr(request, "mm_features", None)
        and getattr(request, "lora_request", None) is None
        and getattr(request, "prompt_embeds", None) is None
    )


class HiCacheRayConnector(KVConnectorBase_V1):  # type: ignore[misc]
    """vLLM's KV connector interface over a hicache-ray store (see the module docstring)."""

    def __init__(self, vllm_config: Any, role: Any, kv_cache_config: Any = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = self._kv_transfer_config.kv_connector_extra_config
        self.options: VLLMStoreOptions = parse_options(extra)
        self._model, self._page_size = model_kv(vllm_config)
        model = vllm_config.model_config
        served = str(model.served_model_name or model.model)
        self._storage = storage_config(self.options, served, str(model.model))
        self._tp_size = int(vllm_config.parallel_config.tensor_parallel_size)
        self._planner: PagePlanner | None = None
        self._requests: dict[str, Any] = {}  # scheduler: the live requests it planned for
        self._mover: BlockMover | None = None
        self._failed: set[int] = set()
        self._reported: dict[str, int] = {}  # worker counts at the last stats report
        self._loader = ThreadPoolExecutor(1, thread_name_prefix="hicache-vllm-load")
        self._loading: dict[str, tuple[PageJob, Future[list[int]]]] = {}  # async loads
        self._layered: LayerByLayer | None = None  # this step's in-step loads
        self._positions: dict[str, int] = {}  # layer name -> place in the mover's layers
        self._acks = SaveAcks(self._tp_size)  # scheduler: pages every worker stored
        self._stored: list[str] = []  # scheduler: stored pages not yet published
        if role == KVConnectorRole.SCHEDULER:
            self._planner = self._open_planner()

    # ------------------------------------------------------------ set-up

    def _open_planner(self) -> PagePlanner:
        suffixes = tp_suffixes(self._model, self._page_size, self._storage, self._tp_size)
        plan = rank_plan(self._model, self._page_size, self._storage, 0, self._tp_size)
        log.info(
            "hicache-ray vLLM connector: %s store, namespace %s, %d objects per page",
            self._storage.backend,
            plan.digest,
            len(suffixes),
        )
        backend = connect(self._storage, plan)
        salt = self._storage.tenant_salt
        return PagePlanner(
            backend, suffixes, self._page_size, salt, load_async=self.options.load_async
        )

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """Order the layers' caches, plan this rank's objects and open the store."""
        named = sorted(kv_caches.items(), key=lambda item: layer_index(item[0]))
        indices = [layer_index(name) for name, _ in named]
        layers = (indices[0], indices[-1] + 1)
        plan = rank_plan(
            self._model, self._page_size, self._storage, _tp_rank(), self._tp_size, layers
        )
        layout = self.options.layout
        if layout == "auto":
            layout = self._platform_layout()
        tensors = [t for _, t in named]
        self._positions = {name: i for i, (name, _) in enumerate(named)}
        self._mover = BlockMover(
            tensors, layout, plan, connect(self._storage, plan), self.options.max_pending_saves
        )

    def _platform_layout(self) -> str:
        """The layout of this platform's attention backend (:data:`BLOCK_LAYOUTS`).

        Raises:
            ConfigError: vLLM's CPU kernels keep K for this dtype and CPU in a layout the
                connector has not verified (AMX, NEON, ...): never wrong KV.
        """
        from vllm.platforms import current_platform

        if not current_platform.is_cpu():
            return "split_content"
        from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

        cache = self._vllm_config.cache_config
        isa = _get_attn_isa(
            self._vllm_config.model_config.dtype,
            cache.block_size,
            self._model.head_dim,
            str(cache.cache_dtype),
        )
        if isa != "vec":
            raise ConfigError(
                "layout",
                f"CPU_ATTN ({isa})",
                "vLLM's CPU attention keeps K for this ISA in a layout not verified here",
                "run with the vec ISA (float32, or a CPU without AMX), or set layout explicitly",
            )
        return "cpu_vec"

    @property
    def counts(self) -> ConnectorStats:
        """Tokens looked up (scheduler) or moved (worker), as running totals."""
        if self._planner is not None:
            return self._planner.counts
        if self._mover is not None:
            return self._mover.counts
        return ConnectorStats()

    # ------------------------------------------------------------ worker side

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        mover = self._mover
        if mover is None or not isinstance(meta, HiCacheRayMeta):
            return
        if not meta.plan.async_loads and meta.plan.loads:
            self._layered = LayerByLayer(mover, meta.plan.loads)
            self._loader.submit(self._layered.run)
            return
        for job in meta.plan.loads:  # one loader thread: loads run in order
            self._loading[job.req_id] = (job, self._loader.submit(mover.load, job))

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose asynchronous load is in (or failed: their blocks are then
        reported by :meth:`get_block_ids_with_load_errors` in the same pass)."""
        done = {rid for rid, (_, future) in self._loading.items() if future.done()}
        for rid in done:
            job, future = self._loading.pop(rid)
            try:
                self._failed.update(future.result())
            except Exception as exc:  # a failed load is a recompute, never a failed request
                log.warning("hicache-ray vLLM connector: a load failed: %s", exc)
                self._failed.update(job.block_ids)
        return None, done or None

    def wait_for_layer_load(self, layer_name: str) -> None:
        """In-step loads (``load_async: false``): until this layer's pages are placed."""
        if self._layered is None:
            return
        position = self._positions.get(layer_name)
        if position is None:
            self._layered.wait_all()
        else:
            self._layered.wait(position)

    def _end_layered(self) -> None:
        """The step's in-step loads are all placed; their failed blocks are reported."""
        if self._layered is not None:
            layered, self._layered = self._layered, None
            self._failed.update(layered.wait_all())

    def save_kv_layer(
        self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any
    ) -> None:
        return  # saves gather every layer at once, after the forward (wait_for_save)

    def wait_for_save(self) -> None:
        self._end_layered()  # after the forward: a layer it did not wait for is in too
        meta = self._get_connector_metadata()
        if self._mover is None or not isinstance(meta, HiCacheRayMeta):
            return
        for job in meta.plan.saves:
            self._mover.save(job)

    def drain_saves(self, timeout_s: float | None = 60.0) -> None:
        """Wait until the saves queued so far are in the store (worker side; tests, and a
        clean hand-over before another engine reads the pages)."""
        if self._mover is not None:
            self._mover.drain(timeout_s)

    def get_kv_connector_kv_cache_events(self) -> SavedPages | None:
        """The pages this worker stored since the last step (for the L3 events)."""
        saved = self._mover.take_saved() if self._mover is not None else []
        return SavedPages(saved) if saved else None

    def get_block_ids_with_load_errors(self) -> set[int]:
        self._end_layered()
        failed, self._failed = self._failed, set()
        return failed

    def shutdown(self) -> None:
        self._loader.shutdown(wait=True)
        if self._mover is not None:
            mover, self._mover = self._mover, None
            mover.close()

    def get_kv_connector_stats(self) -> Any:
        """The tokens this worker moved since the last call (vLLM sums the workers')."""
        if self._mover is None:
            return None
        counts = self._mover.counts
        now = {name: int(getattr(counts, name)) for name in WORKER_FIELDS}
        delta = {name: now[name] - self._reported.get(name, 0) for name in WORKER_FIELDS}
        self._reported = now
        stats = MovedTokens(data=delta)
        return None if stats.is_empty() else stats

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> Any:
        stats = MovedTokens()
        stats.reset()
        return stats.aggregate(MovedTokens(data=dict(data or {})))

    @classmethod
    def build_prom_metrics(
        cls,
        vllm_config: Any,
        metric_types: dict[type, type],
        labelnames: list[str],
        per_engine_labelvalues: dict[int, list[object]],
    ) -> Any:
        return ConnectorProm(vllm_config, metric_types, labelnames, per_engine_labelvalues)

    # ------------------------------------------------------------ scheduler side

    def get_num_new_matched_tokens(
        self, request: Any, num_computed_tokens: int
    ) -> tuple[int | None, bool]:
        assert self._planner is not None
        if not _shareable(request):
            return 0, False  # neither looked up nor saved
        self._requests[request.request_id] = request
        salt = getattr(request, "cache_salt", None) or ""
        tokens = request.prompt_token_ids
        hit = self._planner.lookup(request.request_id, tokens, num_computed_tokens, salt)
        return hit, hit > 0 and self._planner.load_async

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        assert self._planner is not None
        if num_external_tokens > 0:
            block_ids = blocks.get_block_ids()[0]
            self._planner.allocated(request.request_id, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._planner is not None
        scheduled = []
        counts = scheduler_output.num_scheduled_tokens
        new = [(r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        for req_id, computed in new + list(
            zip(cached.req_ids, cached.num_computed_tokens, strict=True)
        ):
            request = self._requests.get(req_id)
            if request is None or self._kv_cache_manager is None:
                continue
            block_ids = self._kv_cache_manager.get_block_ids(req_id)[0]
            after = computed + counts.get(req_id, 0)
            scheduled.append((req_id, after, request.all_token_ids, block_ids))
        return HiCacheRayMeta(self._planner.step(scheduled))

    def update_connector_output(self, connector_output: Any) -> None:
        reports = getattr(connector_output, "kv_cache_events", None)
        if isinstance(reports, SavedPages):
            self._stored += self._acks.add(reports.get_all_events())

    def take_events(self) -> list[Any]:
        """The pages every worker stored since the last call, as one ``BlockStored`` of
        medium ``STORAGE`` (named by page hashes, the 32-byte digests), which vLLM
        publishes with its own KV events when ``kv_events_config`` enables them."""
        if not self._stored:
            return []
        pages, self._stored = self._stored, []
        return [
            BlockStored(
                block_hashes=[bytes.fromhex(p) for p in pages],
                parent_block_hash=None,
                token_ids=[],
                block_size=self._page_size,
                lora_id=None,
                medium=MEDIUM_STORAGE,
                lora_name=None,
            )
        ]

    def request_finished(self, request: Any, block_ids: list[int]) -> tuple[bool, Any]:
        if self._planner is not None:
            self._planner.finished(request.request_id)
        self._requests.pop(request.request_id, None)
        return False, None  # saves copy their blocks out within the step

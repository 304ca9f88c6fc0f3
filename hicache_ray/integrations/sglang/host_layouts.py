"""Where a stored object's bytes sit in an SGLang host pool, for each of its host layouts.

A stored object is ``page-unified-v1``: one page's ``[layers, K/V, tokens, heads, dim]`` for
a layer range and a head group (MLA: one K/V slot and one "head", the latent). SGLang 0.5.23
keeps its host pool (``kv_buffer``) in one of these layouts (P = page size, T = token slots,
L = this stage's layers, H = this rank's KV heads, G x Hg = H cut into head groups)::

    layout             MHA kv_buffer                  MLA kv_buffer
    layer_first        [2, L, T, H, D]                [L, T, 1, D]
    page_first         [2, T, L, H, D]                [T, L, 1, D]
    page_first_direct  [2, pages, L, P, H, D]         [pages, L, P, 1, D]
    page_head          [2, pages, H, P, L, D]         (none)
    page_unified       [pages, G, L, 2, P, Hg, D]     [pages, L, P, D]

:func:`object_view` gives the pool's own bytes of one object of one page as a strided view
whose row-major order is the object's byte order, so moving a page is one vectorised copy
per object (``staging.view(v.shape).copy_(v)``), or none at all when the view is contiguous
(``page_unified`` objects, MLA ``page_first_direct``), where storage reads and writes the
pool in place.

The generic (not ``interface_v1``) path hands pages over flat, in the layout's own order
for one page (SGLang's ``get_data_page(flat=True)``): a flat page is the ``kv_buffer`` of a
one-page pool, so :func:`flat_page_buffer` reshapes it and :func:`object_view` applies.
"""

from __future__ import annotations

import msgspec
import torch

__all__ = ["LAYOUTS", "HostGeometry", "buffer_shape", "flat_page_buffer", "object_view"]

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head", "page_unified")
_MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_unified")


class HostGeometry(msgspec.Struct, frozen=True, kw_only=True):
    """What one SGLang host pool looks like.

    Attributes:
        layout: one of :data:`LAYOUTS`.
        is_mla: one latent vector per token and layer (no K/V pair, no head axis).
        page_size: tokens per page.
        layers: this stage's layers in the pool.
        heads: this rank's KV heads (1 for MLA).
        head_dim: elements of one head of one slot (MLA: the latent plus rope dims).
        head_groups: ``page_unified``'s head groups per page block (1 otherwise).
    """

    layout: str
    is_mla: bool
    page_size: int
    layers: int
    heads: int
    head_dim: int
    head_groups: int = 1

    def __post_init__(self) -> None:
        allowed = _MLA_LAYOUTS if self.is_mla else LAYOUTS
        if self.layout not in allowed:
            kind = "MLA" if self.is_mla else "MHA"
            raise ValueError(f"{kind} host layout {self.layout!r} is not one of {allowed}")
        if min(self.page_size, self.layers, self.heads, self.head_dim, self.head_groups) <= 0:
            raise ValueError(f"host pool dimensions must be positive: {self}")
        if self.heads % self.head_groups:
            raise ValueError(f"{self.head_groups} head groups do not divide {self.heads} heads")

    @property
    def slots(self) -> int:
        return 1 if self.is_mla else 2

    @property
    def page_elems(self) -> int:
        return self.layers * self.slots * self.page_size * self.heads * self.head_dim


def buffer_shape(g: HostGeometry, num_pages: int) -> tuple[int, ...]:
    """The ``kv_buffer`` shape of a pool of ``num_pages`` pages (see the module table)."""
    n, p, h, d = g.layers, g.page_size, g.heads, g.head_dim
    t = num_pages * p
    if g.is_mla:
        return {
            "layer_first": (n, t, 1, d),
            "page_first": (t, n, 1, d),
            "page_first_direct": (num_pages, n, p, 1, d),
            "page_unified": (num_pages, n, p, d),
        }[g.layout]
    return {
        "layer_first": (2, n, t, h, d),
        "page_first": (2, t, n, h, d),
        "page_first_direct": (2, num_pages, n, p, h, d),
        "page_head": (2, num_pages, h, p, n, d),
        "page_unified": (num_pages, g.head_groups, n, 2, p, h // g.head_groups, d),
    }[g.layout]


def flat_page_buffer(g: HostGeometry, flat: torch.Tensor) -> torch.Tensor:
    """A flat page of the generic path as the ``kv_buffer`` of a one-page pool (a view)."""
    if flat.numel() != g.page_elems:
        raise ValueError(f"a flat page of {g.page_elems} elements expected, got {flat.numel()}")
    if not flat.is_contiguous():
        raise ValueError("a flat page must be a contiguous tensor")
    return flat.view(buffer_shape(g, 1))


def object_view(
    buffer: torch.Tensor,
    g: HostGeometry,
    page: int,
    layers: tuple[int, int],
    heads: tuple[int, int],
) -> torch.Tensor:
    """The bytes of one object of ``page`` (local ``layers`` and ``heads``, half-open) in
    ``buffer``, as a view whose row-major order is the object's ``[L, S, P, H, D]``.

    Its shape is ``[L, S, P, H, D]``, or ``[L, S, P, k, Hg, D]`` when the object spans ``k``
    whole ``page_unified`` head groups.
    """
    la, lb = layers
    ha, hb = heads
    p = g.page_size
    if g.is_mla:
        if g.layout == "layer_first":
            block = buffer[:, page * p : (page + 1) * p].unsqueeze(1)
        elif g.layout == "page_first":
            block = buffer[page * p : (page + 1) * p].transpose(0, 1).unsqueeze(1)
        elif g.layout == "page_first_direct":
            block = buffer[page].unsqueeze(1)
        else:  # page_unified: [L, P, D]
            block = buffer[page].unsqueeze(1).unsqueeze(3)
        return block[la:lb]
    if g.layout == "page_unified":
        return _unified_view(buffer[page], g, layers, heads)
    if g.layout == "layer_first":
        block = buffer[:, :, page * p : (page + 1) * p].transpose(0, 1)
    elif g.layout == "page_first":
        block = buffer[:, page * p : (page + 1) * p].permute(2, 0, 1, 3, 4)
    elif g.layout == "page_first_direct":
        block = buffer[:, page].transpose(0, 1)
    else:  # page_head: [2, H, P, L, D]
        block = buffer[:, page].permute(3, 0, 2, 1, 4)
    return block[la:lb, :, :, ha:hb]


def _unified_view(
    block: torch.Tensor, g: HostGeometry, layers: tuple[int, int], heads: tuple[int, int]
) -> torch.Tensor:
    """One object in a ``page_unified`` page block ``[G, L, 2, P, Hg, D]``."""
    la, lb = layers
    ha, hb = heads
    size = g.heads // g.head_groups
    first, last = ha // size, (hb - 1) // size
    if first == last:  # inside one head group: [L, 2, P, h, D]
        return block[first, la:lb, :, :, ha - first * size : hb - first * size]
    if ha % size or hb % size:
        raise ValueError(
            f"heads {ha}..{hb - 1} cut page_unified head groups of {size} heads; the pool's "
            "head_group_num must cut this rank's heads on the store's head grid"
        )
    return block[first : last + 1, la:lb].permute(1, 2, 3, 0, 4, 5)

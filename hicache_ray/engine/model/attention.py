"""Causal attention that reads keys and values from the device pool through a page table.

The keys of positions ``[0, start + T)`` live in pool token slots ``pages[p // P] * P + p %
P``. Runs of consecutive pages are contiguous slots, so each run is read as a view of the
pool tensor (no copy of the prefix). One run goes to torch's fused attention kernel; several
runs are combined with an online softmax (the flash-attention recurrence), so the result
equals one softmax over all keys either way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

__all__ = ["paged_attention", "position_slots"]


def position_slots(pages: Sequence[int], page_size: int, start: int, end: int) -> torch.Tensor:
    """Pool token slots of positions ``[start, end)``."""
    pos = torch.arange(start, end)
    table = torch.tensor(pages, dtype=torch.long)
    return table[pos // page_size] * page_size + pos % page_size


# NOTE: torch's CPU flash-attention kernel also returns the log-sum-exp of each row, which
# is what merging runs needs; it is an internal op, so its absence falls back to the plain
# online softmax below.
_FLASH_WITH_LSE = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)


def _runs_fused(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    runs: list[tuple[int, int, int]],
    page_size: int,
    start: int,
) -> torch.Tensor:
    """Each run through the fused kernel (keys as pool views), merged by log-sum-exp."""
    num_q, hq, d = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    end = start + num_q
    qb = q.to(k_pool.dtype).reshape(num_q, hkv, group, d).permute(1, 2, 0, 3)  # [Hkv,G,T,D]
    q_pos = torch.arange(start, end, device=q.device)[:, None]
    outs, lses = [], []
    for first, pool_page, n in runs:
        lo, hi = first * page_size, min(end, (first + n) * page_size)
        slot = pool_page * page_size
        shape = (hkv, group, hi - lo, d)
        k = k_pool[slot : slot + hi - lo].transpose(0, 1)[:, None].expand(shape)
        v = v_pool[slot : slot + hi - lo].transpose(0, 1)[:, None].expand(shape)
        mask = None
        if hi > start:  # the run holds new tokens: causal within it
            hidden = torch.arange(lo, hi, device=q.device)[None, :] > q_pos
            mask = torch.zeros(hidden.shape, dtype=k.dtype).masked_fill(hidden, float("-inf"))
        out, lse = _FLASH_WITH_LSE(qb, k, v, 0.0, False, attn_mask=mask)  # type: ignore[misc]
        seen = (lo <= q_pos[:, 0]).expand_as(lse)  # else all this run's keys are its future
        outs.append(torch.where(seen[..., None], out.float(), 0.0))
        lses.append(torch.where(seen, lse.float(), float("-inf")))
    lse_all = torch.stack(lses)  # [R, Hkv, G, T]
    weights = torch.exp(lse_all - torch.logsumexp(lse_all, dim=0, keepdim=True))
    merged = (torch.stack(outs) * weights[..., None]).sum(0)  # [Hkv, G, T, D]
    return merged.permute(2, 0, 1, 3).reshape(num_q, hq, d).to(q.dtype)


def _runs(pages: Sequence[int], num_pages: int) -> list[tuple[int, int, int]]:
    """(first page index, first pool page, length) of consecutive pool pages."""
    runs: list[tuple[int, int, int]] = []
    for i in range(num_pages):
        if runs and pages[i] == runs[-1][1] + runs[-1][2]:
            first, pool, n = runs[-1]
            runs[-1] = (first, pool, n + 1)
        else:
            runs.append((i, pages[i], 1))
    return runs


def paged_attention(
    q: torch.Tensor,
    k_pool: torch.Tensor,
    v_pool: torch.Tensor,
    pages: Sequence[int],
    page_size: int,
    start: int,
) -> torch.Tensor:
    """Attention of queries at positions ``[start, start + T)`` over keys ``[0, start + T)``.

    Args:
        q: ``[T, Hq, D]`` (already rotated).
        k_pool, v_pool: ``[slots, Hkv, D]`` pool tensors of one layer holding every key.
        pages: the request's pool pages, covering positions ``[0, start + T)``.

    Returns:
        ``[T, Hq, D]`` in ``q``'s dtype (accumulated in float32).
    """
    num_q, hq, d = q.shape
    hkv = k_pool.shape[1]
    group = hq // hkv
    end = start + num_q
    runs = _runs(pages, -(-end // page_size))
    if len(runs) == 1:  # one contiguous span of slots: the fused kernel reads it in place
        slot = runs[0][1] * page_size
        k = k_pool[slot : slot + end].transpose(0, 1)[None]
        v = v_pool[slot : slot + end].transpose(0, 1)[None]
        visible = (
            torch.arange(end, device=q.device)[None, :]
            <= torch.arange(start, end, device=q.device)[:, None]
        )
        out = torch.nn.functional.scaled_dot_product_attention(
            q.to(k.dtype).transpose(0, 1)[None], k, v, attn_mask=visible, enable_gqa=True
        )
        return out[0].transpose(0, 1).to(q.dtype)
    if q.device.type == "cpu" and _FLASH_WITH_LSE is not None:
        return _runs_fused(q, k_pool, v_pool, runs, page_size, start)
    qf = q.float().reshape(num_q, hkv, group, d) * d**-0.5
    q_pos = torch.arange(start, end, device=q.device).view(1, 1, num_q, 1)
    m = torch.full((hkv, group, num_q, 1), float("-inf"), device=q.device)
    denom = torch.zeros((hkv, group, num_q, 1), device=q.device)
    acc = torch.zeros((hkv, group, num_q, d), device=q.device)
    for first, pool_page, n in runs:
        lo = first * page_size
        hi = min(end, (first + n) * page_size)
        slot = pool_page * page_size
        k = k_pool[slot : slot + hi - lo].float()  # a view of the pool, then this run only
        v = v_pool[slot : slot + hi - lo].float()
        scores = torch.einsum("thgd,shd->hgts", qf, k)
        k_pos = torch.arange(lo, hi, device=q.device).view(1, 1, 1, -1)
        scores = scores.masked_fill(k_pos > q_pos, float("-inf"))
        run_max = scores.amax(dim=-1, keepdim=True)
        new_m = torch.maximum(m, run_max)
        scale = torch.exp(m - new_m)
        probs = torch.exp(scores - new_m)
        denom = denom * scale + probs.sum(dim=-1, keepdim=True)
        acc = acc * scale + torch.einsum("hgts,shd->hgtd", probs, v)
        m = new_m
    out = (acc / denom).permute(2, 0, 1, 3).reshape(num_q, hq, d)
    return out.to(q.dtype)

"""Synthetic KV and token workloads for tests, benchmarks and the demo.

``synthetic_kv`` fills KV with integers that encode (layer, slot, position, token, head,
dim), so a page read back for the wrong tokens, position or layer is visible. Values are
kept below 2048, which float16 and float32 represent exactly (bfloat16: below 256).
"""

from __future__ import annotations

import random

import torch

from hicache_ray.base.layout import ShardKV

__all__ = ["multi_turn_prompts", "random_tokens", "shared_prefix_requests", "synthetic_kv"]


def random_tokens(vocab: int, n: int, seed: int) -> list[int]:
    """``n`` token ids below ``vocab``, the same for the same seed."""
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, vocab, (n,), generator=g).tolist()


def synthetic_kv(
    kv: ShardKV, layer: int, slot: int, positions: list[int], tokens: list[int]
) -> torch.Tensor:
    """``[len(positions), local_heads, slot_dim]`` KV for one global layer and slot."""
    modulus = 251 if kv.model.dtype == "bfloat16" else 2039
    pos = torch.tensor(positions, dtype=torch.int64)[:, None, None]
    tok = torch.tensor(tokens, dtype=torch.int64)[:, None, None]
    head = torch.arange(kv.first_head, kv.first_head + kv.local_heads)[None, :, None]
    dim = torch.arange(kv.slot_dim)[None, None, :]
    mixed = tok * 7919 + pos * 104729 + layer * 613 + slot * 307 + head * 31 + dim
    return (mixed % modulus).to(kv.dtype)


def shared_prefix_requests(
    num_requests: int,
    num_prefixes: int,
    prefix_len: int,
    suffix_len: int,
    *,
    vocab: int = 32000,
    seed: int = 0,
) -> list[list[int]]:
    """Requests made of one of ``num_prefixes`` shared prefixes plus a unique suffix."""
    rnd = random.Random(seed)
    prefixes = [[rnd.randrange(vocab) for _ in range(prefix_len)] for _ in range(num_prefixes)]
    return [
        prefixes[rnd.randrange(num_prefixes)] + [rnd.randrange(vocab) for _ in range(suffix_len)]
        for _ in range(num_requests)
    ]


def multi_turn_prompts(
    num_clients: int,
    num_rounds: int,
    system_len: int,
    user_len: int,
    answer_len: int,
    *,
    vocab: int = 32000,
    seed: int = 0,
) -> list[list[list[int]]]:
    """``prompts[round][client]``: each round's prompt extends the client's previous one.

    Every client shares one system prompt; each round appends the previous answer (as
    tokens) and a new user turn, so round r's prompt is round r-1's plus new tokens.
    """
    rnd = random.Random(seed)
    system = [rnd.randrange(vocab) for _ in range(system_len)]
    history = [list(system) for _ in range(num_clients)]
    rounds: list[list[list[int]]] = []
    for r in range(num_rounds):
        prompts = []
        for c in range(num_clients):
            if r:
                history[c] += [rnd.randrange(vocab) for _ in range(answer_len)]
            history[c] += [rnd.randrange(vocab) for _ in range(user_len)]
            prompts.append(list(history[c]))
        rounds.append(prompts)
    return rounds

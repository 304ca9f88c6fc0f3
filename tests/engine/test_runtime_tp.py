"""TP=2 (two processes, gloo) against TP=1: same logits within tolerance, same greedy tokens."""

from __future__ import annotations

import torch

from tests.controller.test_multirank import collect, spawn
from tests.engine import ranks as runtime_ranks
from tests.engine.test_runtime import TOL, GenerateRequest, prompt, run, runtime


def test_tensor_parallel_runtime_matches_one_rank() -> None:
    base = prompt(7, 26)
    requests = [("first", base, 8), ("second", base + prompt(8, 6), 8)]
    procs, out, ports = spawn(2, runtime_ranks.tp_rank_main, requests)
    results = dict(collect(procs, out, ports, 2))
    single = runtime(None)
    for rid, tokens, max_new in requests:
        expected = run(single, GenerateRequest(rid, tokens, max_new))
        ref_logits = single.first_logits[rid]
        for rank in (0, 1):
            got_tokens, device_hits, logits = results[rank][rid]
            assert got_tokens == expected.output_tokens, (rank, rid)
            assert device_hits == expected.device_hit_tokens, (rank, rid)
            got = torch.tensor(logits)
            assert torch.allclose(got, ref_logits, atol=TOL, rtol=0), (got - ref_logits).abs().max()
    assert results[0]["second"][1] > 0  # the second request reused the first one's KV
    single.ctl.close()

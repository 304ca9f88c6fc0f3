"""``hicache-ray serve``'s prefill/decode options, checked before anything starts."""

from __future__ import annotations

import pytest

from hicache_ray.base.errors import ConfigError
from hicache_ray.serving.serve_options import PDServe, serve_pd


def test_no_sizes_is_one_deployment_and_both_make_a_pair() -> None:
    assert serve_pd({}) is None
    assert serve_pd({"prefill_tp": "0", "decode_tp": "0"}) is None
    assert serve_pd({"prefill_tp": "2", "decode_tp": "1"}) == PDServe(2, 1, 2048)
    pair = serve_pd({"prefill_tp": "4", "decode_tp": "2", "pd_min_uncached": "64"})
    assert pair == PDServe(4, 2, 64)
    three = serve_pd({"prefill_tp": "1", "decode_tp": "1", "prefill_replicas": "3"})
    assert three == PDServe(1, 1, 2048, 3)


@pytest.mark.parametrize(
    ("args", "field"),
    [
        ({"prefill_tp": "2"}, "decode_tp"),  # one side without the other
        ({"decode_tp": "1"}, "prefill_tp"),
        ({"prefill_tp": "two", "decode_tp": "1"}, "prefill_tp"),
        ({"prefill_tp": "2", "decode_tp": "65"}, "decode_tp"),
        ({"prefill_tp": "2", "decode_tp": "1", "storage": "none"}, "storage"),
        ({"prefill_tp": "2", "decode_tp": "1", "replicas": "2"}, "prefill_tp"),
        ({"prefill_tp": "2", "decode_tp": "1", "engine": "vllm"}, "prefill_tp"),
        ({"prefill_tp": "2", "decode_tp": "1", "pd_min_uncached": "-1"}, "pd_min_uncached"),
        ({"prefill_replicas": "2"}, "prefill_replicas"),  # replicas of no pair
        ({"prefill_tp": "1", "decode_tp": "1", "prefill_replicas": "0"}, "prefill_replicas"),
        ({"prefill_tp": "1", "decode_tp": "1", "prefill_replicas": "65"}, "prefill_replicas"),
        ({"prefill_tp": "1", "decode_tp": "1", "prefill_replicas": "1.5"}, "prefill_replicas"),
    ],
)
def test_a_bad_pair_is_refused_naming_its_option(args: dict[str, str], field: str) -> None:
    with pytest.raises(ConfigError) as caught:
        serve_pd(args)
    assert caught.value.field == field

"""Every request is checked by type and range where it enters (hicache_ray.engine.request)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from hicache_ray.engine.request import (
    GenerateRequest,
    RequestError,
    check_batch,
    check_limits,
    check_request,
    error_result,
)

# (request, field the error names): every wrongly typed or out-of-range case
BAD: list[tuple[Any, str]] = [
    (GenerateRequest("a", [1.0, 2.0], 4), "tokens"),
    (GenerateRequest("a", [1, 2.5], 4), "tokens"),
    (GenerateRequest("a", [True, 2], 4), "tokens"),
    (GenerateRequest("a", [None], 4), "tokens"),
    (GenerateRequest("a", ["1"], 4), "tokens"),
    (GenerateRequest("a", "1234", 4), "tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", {1: 2}, 4), "tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", np.array([1.0, 2.0]), 4), "tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", np.array([[1, 2]]), 4), "tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", torch.tensor([1.5]), 4), "tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", torch.tensor([True]), 4), "tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", [], 4), "tokens"),
    (GenerateRequest("a", [-1], 4), "tokens"),
    (GenerateRequest("a", [1 << 40], 4), "tokens"),
    (GenerateRequest("a", [1, 2], 2.5), "max_new_tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", [1, 2], None), "max_new_tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", [1, 2], "4"), "max_new_tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", [1, 2], True), "max_new_tokens"),  # type: ignore[arg-type]
    (GenerateRequest("a", [1, 2], -1), "max_new_tokens"),
    (GenerateRequest("a", [1, 2], 1 << 40), "max_new_tokens"),
    (GenerateRequest(None, [1, 2], 4), "rid"),  # type: ignore[arg-type]
    (GenerateRequest(123, [1, 2], 4), "rid"),  # type: ignore[arg-type]
    (GenerateRequest(["x"], [1, 2], 4), "rid"),  # type: ignore[arg-type]
    (GenerateRequest("", [1, 2], 4), "rid"),
    (GenerateRequest("x" * 300, [1, 2], 4), "rid"),
    ({"rid": "a", "tokens": [1], "max_new_tokens": 1}, "request"),
    (None, "request"),
    ("abc", "request"),
]


@pytest.mark.parametrize(("request_", "field"), BAD)
def test_bad_requests_name_the_field(request_: Any, field: str) -> None:
    with pytest.raises(RequestError) as info:
        check_request(request_)
    assert info.value.field == field and str(info.value).startswith(f"{field}: ")
    result = error_result(request_, str(info.value))
    assert result.error == str(info.value) and isinstance(result.rid, str)


@pytest.mark.parametrize(
    "tokens",
    [
        [3, 4, 5],
        (3, 4, 5),
        [np.int64(3), np.int32(4), 5],
        np.array([3, 4, 5], dtype=np.int64),
        np.array([3, 4, 5], dtype=np.uint16),
        torch.tensor([3, 4, 5]),
        torch.tensor([3, 4, 5], dtype=torch.int32),
    ],
)
def test_integer_arrays_are_converted_exactly(tokens: Any) -> None:
    checked = check_request(GenerateRequest("a", tokens, np.int64(2)))  # type: ignore[arg-type]
    assert checked.tokens == [3, 4, 5] and all(type(t) is int for t in checked.tokens)
    assert checked.max_new_tokens == 2 and type(checked.max_new_tokens) is int


def test_limits_of_the_model_and_the_pool() -> None:
    ok = GenerateRequest("a", [1, 2, 3], 4)
    check_limits(ok, vocab_size=8, capacity_tokens=7)
    with pytest.raises(RequestError, match="vocabulary"):
        check_limits(GenerateRequest("a", [8], 1), vocab_size=8, capacity_tokens=100)
    with pytest.raises(RequestError, match="can never fit"):
        check_limits(ok, vocab_size=8, capacity_tokens=6)


def test_a_call_takes_a_sequence_of_requests() -> None:
    assert check_batch([]) == []
    for bad in ("abc", b"abc", GenerateRequest("a", [1], 1), 5, {"a": 1}):
        with pytest.raises(TypeError, match="sequence of GenerateRequest"):
            check_batch(bad)


def test_request_errors_survive_pickling() -> None:
    import pickle

    err = RequestError("tokens", "empty prompt")
    back = pickle.loads(pickle.dumps(err))
    assert type(back) is RequestError and back.field == "tokens" and str(back) == str(err)

"""What Ray's prefix router reads from a parsed call: the client's text where it sent
some, the prompt's token ids written out where it sent none (token ids, or messages with
empty contents), so that router never meets an empty prompt (it stalls on one). Read
with Ray's own extraction code; no cluster needed."""

from __future__ import annotations

from collections.abc import Sequence
from types import SimpleNamespace
from typing import Any

import msgspec
import pytest

from hicache_ray.serving.openai.protocol import ChatRequest, CompletionRequest, Message, OpenAIError
from hicache_ray.serving.openai.text import IdText, TextCodec
from tests.actors.helpers import MODEL

actors = pytest.importorskip("actors")
prefix_router = pytest.importorskip(
    "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router"
)
from actors.openai_engine import parse_call  # noqa: E402


class _Chat(TextCodec):
    """A codec whose chat template opens every message with a marker token."""

    def encode(self, prompt: str | list[int]) -> list[int]:
        return IdText().encode(prompt)

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        return [t for m in messages for t in (7, *map(len, m.content.split()))] + [9]

    def decode(self, tokens: Sequence[int]) -> str:
        return IdText().decode(tokens)


def _call(body: dict[str, Any], chat: bool = False) -> Any:
    config = actors.DeploymentConfig(model=MODEL)
    kind = ChatRequest if chat else CompletionRequest
    return parse_call(msgspec.json.encode({"model": "m", **body}), kind, _Chat(), config, "m")


def _routed(body: dict[str, Any], chat: bool = False) -> str:
    """The text Ray's ``PrefixCacheAffinityRouter`` reads from the call of ``body``."""
    call = _call(body, chat)
    router = prefix_router.PrefixCacheAffinityRouter.__new__(
        prefix_router.PrefixCacheAffinityRouter
    )
    text: str = router._extract_text_from_request(SimpleNamespace(args=[call]))
    return text


def test_a_text_prompt_is_read_as_sent() -> None:
    assert _routed({"prompt": "5 6 7"}) == "5 6 7"


def test_token_ids_are_read_written_out_and_a_longer_prompt_extends_them() -> None:
    first = _routed({"prompt": [5, 60, 7]})
    assert first == "5 60 7"
    assert _routed({"prompt": [5, 60, 7, 8]}).startswith(first)


def test_chat_messages_are_read_as_sent() -> None:
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    assert _routed({"messages": messages}, chat=True) == "be briefhi"


def test_chat_messages_without_text_are_read_as_the_templates_token_ids() -> None:
    messages = [{"role": "system", "content": ""}, {"role": "user", "content": ""}]
    assert _routed({"messages": messages}, chat=True) == "7 7 9"


def test_the_token_ids_are_written_out_only_when_the_router_asks() -> None:
    call = _call({"prompt": list(range(4096))})
    assert "prompt" not in vars(call)  # the cache and pow2 routers never pay for it
    assert call.prompt.endswith(" 4095") and "prompt" in vars(call)


@pytest.mark.parametrize("prompt", ["", []])
def test_an_empty_prompt_is_refused_before_any_router(prompt: str | list[int]) -> None:
    with pytest.raises(OpenAIError) as refused:
        _call({"prompt": prompt})
    assert refused.value.status == 400 and refused.value.param == "prompt"

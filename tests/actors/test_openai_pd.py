"""``hicache-ray serve --prefill-tp 2 --decode-tp 1``: the OpenAI app over a prefill/decode
pair (a tiny random Qwen3 checkpoint, the official ``openai`` client on 127.0.0.1). A long
prompt is prefilled apart and reaches the decode side through L3; the answer is the same
streamed or not, handed off or computed where it decodes."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import ensure_local_ray, free_port
from tests.model.helpers import make_checkpoint

openai = pytest.importorskip("openai")
pytest.importorskip("transformers")
ray = pytest.importorskip("ray")

STORE = "openai-pd-test"


@pytest.fixture(scope="module")
def port(tmp_path_factory: pytest.TempPathFactory) -> Iterator[int]:
    from ray import serve

    from actors.openai_app import build_app
    from actors.stores import store_exists

    ensure_local_ray()
    checkpoint = make_checkpoint(tmp_path_factory.mktemp("openai-pd") / "qwen3", "qwen3")
    free = free_port()
    serve.start(http_options={"host": "127.0.0.1", "port": free})
    args = {
        "model": str(checkpoint),
        "prefill_tp": "1",
        "prefill_replicas": "2",  # two prefill deployments behind the one door
        "decode_tp": "1",
        "pd_min_uncached": "32",
        "device_tokens": "1024",
        "page_size": "4",
        "store": STORE,
    }
    try:
        serve.run(build_app(args), name="openai-pd", route_prefix="/")
        yield free
    finally:
        serve.shutdown()
    assert not store_exists(STORE)  # the app dropped its L3 store when it shut down


def _tiers(usage: Any) -> dict[str, int]:
    extra: dict[str, int] = (usage.prompt_tokens_details.model_extra or {})["hicache"]
    return extra


def test_a_long_prompt_is_handed_off_through_l3(port: int) -> None:
    client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="-", max_retries=0)
    ids = [(7 * i + 3) % 200 + 5 for i in range(64)]
    handed = client.completions.create(model="qwen3", prompt=ids, max_tokens=6, temperature=0)
    # the decode side read every page but the last one's from L3: the prefill side's
    assert _tiers(handed.usage)["l3"] >= 60 - 4, handed.usage
    short = client.completions.create(model="qwen3", prompt=ids[:8], max_tokens=6, temperature=0)
    assert _tiers(short.usage)["l3"] == 0  # short: prefilled where it decodes
    stream = client.completions.create(
        model="qwen3", prompt=ids, max_tokens=6, temperature=0, stream=True
    )
    text = "".join(chunk.choices[0].text for chunk in stream if chunk.choices)
    assert text == handed.choices[0].text

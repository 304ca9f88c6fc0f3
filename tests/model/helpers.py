"""Helpers of the model tests: tiny Hugging Face checkpoints made here with
``transformers`` (nothing is downloaded: random weights, float32, eager attention, saved as
safetensors with a word-level tokenizer and a chat template in the same directory), and two
TP ranks of the reference model as two threads of one process, summing their partials at
every all-reduce (TP over gloo in separate processes is tested with the runtime)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from hicache_ray.base.layout import Shard
from hicache_ray.engine.model import ReferenceModel

VOCAB = 320
CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|> {{ m['content'] }} <|end|> {% endfor %}"
    "{% if add_generation_prompt %}<|assistant|> {% endif %}"
)
WORDS = [
    "hello", "world", "the", "cache", "is", "fast", "ray", "serve", "a", "model", "what",
    "how", "why", "tokens", "pages", "layer", "head", "store", "page", "kv",
]  # fmt: skip


def _family(name: str) -> tuple[Any, Any, dict[str, Any]]:
    import transformers as tf

    extra: dict[str, Any] = {}
    if name == "llama":
        return tf.LlamaConfig, tf.LlamaForCausalLM, extra
    if name == "llama3-rope":
        extra = {
            "rope_scaling": {
                "rope_type": "llama3",
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64,
            }
        }
        return tf.LlamaConfig, tf.LlamaForCausalLM, extra
    if name == "linear-rope-tied":
        linear = {"rope_type": "linear", "factor": 2.0}
        extra = {"rope_scaling": linear, "tie_word_embeddings": True}
        return tf.LlamaConfig, tf.LlamaForCausalLM, extra
    if name == "mistral":
        return tf.MistralConfig, tf.MistralForCausalLM, {"sliding_window": None}
    if name == "qwen2":
        return tf.Qwen2Config, tf.Qwen2ForCausalLM, {"use_sliding_window": False}
    if name == "qwen3":
        return tf.Qwen3Config, tf.Qwen3ForCausalLM, {"head_dim": 24, "use_sliding_window": False}
    raise ValueError(name)


FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "llama3-rope", "linear-rope-tied"]


def make_tokenizer(path: Path) -> None:
    """A word-level tokenizer over ``WORDS`` plus special tokens, with the chat template."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"]
    vocab = {tok: i for i, tok in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        additional_special_tokens=specials[3:],
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(path))


def make_checkpoint(
    path: Path,
    family: str,
    *,
    seed: int = 0,
    shard_size: str = "",
    hidden_size: int = 64,
    max_positions: int = 512,
) -> Path:
    """Save a tiny random ``family`` model (and tokenizer) to ``path``; returns it (4 heads
    of ``hidden_size / 4``, 2 KV heads, ``max_positions`` long)."""
    config_cls, model_cls, extra = _family(family)
    config = config_cls(
        vocab_size=VOCAB,
        hidden_size=hidden_size,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        rms_norm_eps=1e-6,
        eos_token_id=2,
        bos_token_id=1,
        **({"tie_word_embeddings": False} | extra),
    )
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_cls(config).float().eval()
    with torch.no_grad():  # larger than the defaults, so the logits are not all near zero
        for p in model.parameters():
            p.normal_(0.0, 0.08 if p.dim() > 1 else 0.3).add_(1.0 if p.dim() == 1 else 0.0)
    kwargs = {"max_shard_size": shard_size} if shard_size else {}
    model.save_pretrained(str(path), safe_serialization=True, **kwargs)
    make_tokenizer(path)
    return path


def hf_logits(path: Path, tokens: list[int]) -> torch.Tensor:
    """``[len(tokens), vocab]`` logits of the checkpoint in transformers (float32, eager)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=torch.float32, attn_implementation="eager"
    ).eval()
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float()  # type: ignore[no-any-return]


def tp2_forward(
    config: Any, forward: Callable[[ReferenceModel, Shard], torch.Tensor]
) -> list[torch.Tensor]:
    """``forward(model, shard)`` of each of the two TP=2 ranks, run at once."""
    partials: dict[int, list[torch.Tensor]] = {0: [], 1: []}
    barrier = threading.Barrier(2)

    def summed(rank: int) -> Callable[[torch.Tensor], None]:
        def reduce(t: torch.Tensor) -> None:  # a SUM all-reduce between two threads
            partials[rank].append(t.clone())
            barrier.wait()
            t.copy_(partials[0][-1] + partials[1][-1])
            barrier.wait()

        return reduce

    shards = [Shard(tp_rank=r, tp_size=2) for r in range(2)]
    models = [ReferenceModel(config, s, tp_all_reduce=summed(r)) for r, s in enumerate(shards)]
    results: dict[int, torch.Tensor] = {}

    def run(r: int) -> None:
        results[r] = forward(models[r], shards[r])

    threads = [threading.Thread(target=run, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    return [results[0], results[1]]

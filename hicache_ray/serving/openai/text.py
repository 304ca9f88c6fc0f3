"""Text in and out: the checkpoint's tokenizer and chat template, and incremental decoding
that stops at stop strings.

A checkpoint's tokenizer comes from its own directory (``transformers.AutoTokenizer``; no
download). The random presets have no tokenizer: their prompts are token ids (a JSON list,
or a string of space-separated ids) and their text is the ids, space-separated.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import Any

from hicache_ray.serving.openai.protocol import Message, OpenAIError

__all__ = ["IdText", "IncrementalText", "TextCodec", "TokenizerText", "text_codec"]


class TextCodec(ABC):
    """Prompts to token ids, token ids to text."""

    eos_token_ids: tuple[int, ...] = ()

    @abstractmethod
    def encode(self, prompt: str | list[int]) -> list[int]:
        """A completion prompt's token ids."""

    @abstractmethod
    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        """The chat template over ``messages``, with the assistant's turn opened."""

    @abstractmethod
    def decode(self, tokens: Sequence[int]) -> str:
        """The text of ``tokens`` (special tokens left out)."""


class TokenizerText(TextCodec):
    """A Hugging Face tokenizer from a checkpoint directory."""

    def __init__(self, path: str) -> None:
        from transformers import AutoTokenizer

        self.tokenizer: Any = AutoTokenizer.from_pretrained(path)

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        ids: list[int] = self.tokenizer(prompt)["input_ids"]
        return ids

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        if not getattr(self.tokenizer, "chat_template", None):
            raise OpenAIError(400, "this model has no chat template: use /v1/completions")
        rendered = self.tokenizer.apply_chat_template(
            [{"role": m.role, "content": m.content} for m in messages],
            add_generation_prompt=True,
            tokenize=True,
        )
        ids = rendered["input_ids"] if hasattr(rendered, "keys") else rendered
        return list(ids)

    def decode(self, tokens: Sequence[int]) -> str:
        text: str = self.tokenizer.decode(list(tokens), skip_special_tokens=True)
        return text


class IdText(TextCodec):
    """The random presets: token ids in, token ids (as text) out."""

    def encode(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        try:
            return [int(t) for t in prompt.split()]
        except ValueError:
            raise OpenAIError(
                400, "this model has no tokenizer: give the prompt as token ids", param="prompt"
            ) from None

    def encode_chat(self, messages: Sequence[Message]) -> list[int]:
        raise OpenAIError(400, "this model has no tokenizer or chat template: use /v1/completions")

    def decode(self, tokens: Sequence[int]) -> str:
        return "".join(f" {t}" for t in tokens)


def text_codec(checkpoint: str) -> TextCodec:
    """The checkpoint's tokenizer, or token ids for a random preset (no checkpoint)."""
    return TokenizerText(checkpoint) if checkpoint else IdText()


class IncrementalText:
    """Text of a growing list of tokens, released piece by piece: a piece never ends in a
    half-decoded character or a possible start of a stop string, and the text ends just
    before the first stop string (``stopped``)."""

    def __init__(self, codec: TextCodec, stops: Sequence[str] = ()) -> None:
        self.codec = codec
        self.stops = [s for s in stops if s]
        self.tokens: list[int] = []
        self.text = ""  # released so far
        self.stopped = False
        self._hold = max((len(s) for s in self.stops), default=1) - 1

    def add(self, tokens: Sequence[int]) -> str:
        """Take new tokens; returns the text newly safe to release."""
        if self.stopped:
            return ""
        self.tokens.extend(tokens)
        full = self.codec.decode(self.tokens)
        for stop in self.stops:
            at = full.find(stop, max(0, len(self.text) - len(stop)))
            if at != -1:
                self.stopped = True
                full = full[:at]
        safe = len(full) if self.stopped else len(full) - self._hold
        while safe > len(self.text) and full[safe - 1 : safe] == "\ufffd":
            safe -= 1  # a character whose bytes have not all arrived
        piece = full[len(self.text) : max(safe, len(self.text))]
        self.text += piece
        return piece

    def finish(self) -> str:
        """The rest of the text once no more tokens come."""
        if self.stopped:
            return ""
        full = self.codec.decode(self.tokens)
        piece = full[len(self.text) :]
        self.text = full
        return piece

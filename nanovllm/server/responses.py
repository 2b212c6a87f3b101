"""The response bodies and stream chunks of both endpoints, built from the engine loop's ``Delta``s.

``CompletionFormat`` and ``ChatFormat`` differ only in how one choice's piece of text is wrapped (``text`` vs
``delta`` / ``message``) and how logprobs are laid out (OpenAI's legacy completion layout vs chat's
``content`` list); the stream and the whole response are assembled the same way by ``app``.
"""

from __future__ import annotations

import abc
import time
from dataclasses import dataclass, field
from typing import Any

from nanovllm.outputs import Logprob
from nanovllm.server.engine_loop import Delta


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
    """OpenAI's ``usage`` object; ``cached_tokens`` are the prompt tokens the prefix cache served."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


@dataclass
class Choice:
    """One choice of a response, accumulated from its deltas (non-streaming, and for the usage totals)."""

    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    last: Delta | None = None

    def add(self, delta: Delta) -> None:
        self.text += delta.text
        self.token_ids += delta.token_ids
        self.logprobs += delta.logprobs or []
        self.last = delta

    @property
    def done(self) -> bool:
        return self.last is not None and self.last.final


def total_usage(choices: list[Choice]) -> dict[str, Any]:
    """Usage over every choice of a response (each choice is its own prompt for a batch of prompts)."""
    seen = [c.last for c in choices if c.last is not None]
    return usage(sum(d.prompt_tokens for d in seen), sum(d.completion_tokens for d in seen),
                 sum(d.cached_tokens for d in seen))


class ResponseFormat(abc.ABC):
    """What both endpoints share: the envelope of a chunk or response."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, response_id: str, model: str, tokenizer: Any, top_logprobs: int | None) -> None:
        self.id = response_id
        self.model = model
        self.created = int(time.time())
        self.tokenizer = tokenizer
        self.top_logprobs = top_logprobs  # None: no logprobs asked for

    def envelope(self, obj: str, choices: list[dict[str, Any]]) -> dict[str, Any]:
        return {"id": self.id, "object": obj, "created": self.created, "model": self.model, "choices": choices}

    def usage_chunk(self, choices: list[Choice]) -> dict[str, Any]:
        """The last chunk of a stream asked for with ``include_usage``: no choices, the totals."""
        return {**self.envelope(self.chunk_object_name, []), "usage": total_usage(choices)}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        return []

    @abc.abstractmethod
    def chunk(self, index: int, delta: Delta, offset: int = 0) -> dict[str, Any] | None:
        """One streamed chunk for ``delta`` of choice ``index`` (None: nothing to send for it); ``offset``: the
        characters of that choice's text streamed before it."""

    @abc.abstractmethod
    def response(self, choices: list[Choice]) -> dict[str, Any]:
        """The whole non-streaming response body."""


class CompletionFormat(ResponseFormat):
    object_name = chunk_object_name = "text_completion"

    def logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]], offset: int) -> dict[str, Any] | None:
        """OpenAI's completion layout: per token its text, logprob, top alternatives and text offset."""
        if self.top_logprobs is None or not entries:
            return None if self.top_logprobs is None else {"tokens": [], "token_logprobs": [], "top_logprobs": [],
                                                           "text_offset": []}
        tokens = [self.token_text(t) for t in token_ids]
        offsets = []
        for text in tokens:
            offsets.append(offset)
            offset += len(text)
        return {"tokens": tokens,
                "token_logprobs": [entry[t].logprob for t, entry in zip(token_ids, entries)],
                "top_logprobs": [{self.token_text(t): lp.logprob for t, lp in sorted(entry.items(),
                                                                                    key=lambda kv: kv[1].rank)}
                                 for entry in entries],
                "text_offset": offsets}

    def chunk(self, index: int, delta: Delta, offset: int = 0) -> dict[str, Any] | None:
        if not delta.text and not delta.final and not delta.token_ids:
            return None
        choice = {"index": index, "text": delta.text,
                  "logprobs": self.logprobs(delta.token_ids, delta.logprobs or [], offset),
                  "finish_reason": delta.finish_reason}
        return self.envelope(self.chunk_object_name, [choice])

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        body = [{"index": i, "text": c.text, "logprobs": self.logprobs(c.token_ids, c.logprobs, 0),
                 "finish_reason": c.last.finish_reason if c.last else None} for i, c in enumerate(choices)]
        return {**self.envelope(self.object_name, body), "usage": total_usage(choices)}


class ChatFormat(ResponseFormat):
    object_name = "chat.completion"
    chunk_object_name = "chat.completion.chunk"

    def logprobs(self, token_ids: list[int], entries: list[dict[int, Logprob]]) -> dict[str, Any] | None:
        """Chat's layout: ``content``, per token its text, logprob, UTF-8 bytes and the top alternatives."""
        if self.top_logprobs is None:
            return None

        def item(token_id: int, lp: Logprob) -> dict[str, Any]:
            text = self.token_text(token_id)
            return {"token": text, "logprob": lp.logprob, "bytes": list(text.encode("utf-8"))}

        content = []
        for token_id, entry in zip(token_ids, entries):
            top = sorted(entry.items(), key=lambda kv: kv[1].rank)[:self.top_logprobs]
            content.append({**item(token_id, entry[token_id]), "top_logprobs": [item(t, lp) for t, lp in top]})
        return {"content": content}

    def opening_chunks(self, num_choices: int) -> list[dict[str, Any]]:
        """Chat streams open with the assistant's role, one chunk per choice."""
        return [self.envelope(self.chunk_object_name, [{"index": i, "delta": {"role": "assistant", "content": ""},
                                                        "logprobs": None, "finish_reason": None}])
                for i in range(num_choices)]

    def chunk(self, index: int, delta: Delta, offset: int = 0) -> dict[str, Any] | None:
        if not delta.text and not delta.final and not delta.token_ids:
            return None
        piece = {"content": delta.text} if delta.text or not delta.final else {}
        choice = {"index": index, "delta": piece, "logprobs": self.logprobs(delta.token_ids, delta.logprobs or []),
                  "finish_reason": delta.finish_reason}
        return self.envelope(self.chunk_object_name, [choice])

    def response(self, choices: list[Choice]) -> dict[str, Any]:
        body = [{"index": i, "message": {"role": "assistant", "content": c.text},
                 "logprobs": self.logprobs(c.token_ids, c.logprobs),
                 "finish_reason": c.last.finish_reason if c.last else None} for i, c in enumerate(choices)]
        return {**self.envelope(self.object_name, body), "usage": total_usage(choices)}

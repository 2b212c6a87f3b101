"""The request bodies of ``/v1/completions`` and ``/v1/chat/completions``: OpenAI's fields, plus vLLM's
``ignore_eos``, ``top_k``, ``stop_token_ids``, ``priority`` and ``repetition_penalty`` (neutral only).

Strict pydantic models: a wrong type (``"max_tokens": "8"``, ``"temperature": true``), an unknown field or an
impossible value is refused before anything reaches the engine, with the field named (``errors`` turns it into
HTTP 400 and OpenAI's error object). Fields that the OpenAI API defines but nano-vllm does not implement are
accepted only at their neutral value (``n=1``, ``echo=false``, no penalties), so a client never gets a
silently different behaviour. What depends on the engine (the prompt's length against ``max_model_len``, the
``logprobs`` cap, token ids in the vocabulary) is checked by ``LLMEngine.make_request``.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from nanovllm.sampling import SamplingParams

# OpenAI's defaults where they differ from SamplingParams': temperature 1, completions 16 tokens.
DEFAULT_TEMPERATURE = 1.0
DEFAULT_COMPLETION_MAX_TOKENS = 16


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False             # a last chunk with the usage, and ``choices: []``
    continuous_usage_stats: bool = False    # vLLM: the usage so far on every chunk


class GenerationRequest(_Strict):
    """The fields both endpoints share."""

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = Field(default=None, gt=0, le=1)
    top_k: int | None = None                 # vLLM: -1 (or 0) disables
    seed: int | None = Field(default=None, ge=0, lt=2**64)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    priority: int = 0                        # vLLM: a lower value is served first (scheduler=priority)
    user: str | None = None                  # accepted and recorded nowhere, as OpenAI's own
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    timeout: float | None = Field(default=None, gt=0)   # seconds until it is aborted (408); server.request_timeout

    @model_validator(mode="after")
    def _supported(self) -> "GenerationRequest":
        if self.n != 1:
            raise ValueError("n: only n=1 is supported")
        for name, neutral in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0)):
            if getattr(self, name) != neutral:
                raise ValueError(f"{name}: not supported; only {neutral} is accepted")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options: only allowed when stream is true")
        return self

    @property
    def stop_strings(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.continuous_usage_stats

    def requested_max_tokens(self) -> int | None:
        """``max_completion_tokens`` (OpenAI's newer name) else ``max_tokens``; None: the endpoint's default."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def sampling_params(self, max_tokens: int, logprobs: int | None) -> SamplingParams:
        """The engine's parameters (``SamplingParams`` raises ``ValueError`` naming a bad field)."""
        top_k = -1 if self.top_k in (None, 0) else self.top_k
        return SamplingParams(
            temperature=DEFAULT_TEMPERATURE if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p, top_k=top_k, max_tokens=max_tokens,
            ignore_eos=self.ignore_eos, stop_token_ids=self.stop_token_ids, seed=self.seed, logprobs=logprobs)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``. ``prompt``: a string, token ids, or a list of either (one choice each)."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None

    @model_validator(mode="after")
    def _completion_supported(self) -> "CompletionRequest":
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt: must not be empty")
        if self.echo:
            raise ValueError("echo: not supported; only false is accepted")
        if self.suffix is not None:
            raise ValueError("suffix: not supported")
        if self.best_of not in (None, 1):
            raise ValueError("best_of: only 1 is supported")
        return self

    def prompts(self) -> list[str | list[int]]:
        """One engine prompt per choice: the string or token-id list(s) as given."""
        prompt = self.prompt
        if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
            return [prompt]  # type: ignore[list-item]
        return list(prompt)  # type: ignore[arg-type]


class TextPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[TextPart] | None = None
    name: str | None = None

    def as_template_message(self) -> dict[str, str]:
        """``{"role", "content"}`` for the chat template; text parts joined by newlines (as vLLM does)."""
        content = self.content if isinstance(self.content, str) or self.content is None \
            else "\n".join(part.text for part in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": content or ""}


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``: ``messages`` through the model's chat template, one choice."""

    messages: list[ChatMessage] = Field(min_length=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0)

    @model_validator(mode="after")
    def _chat_supported(self) -> "ChatCompletionRequest":
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs: only allowed when logprobs is true")
        return self

    def engine_logprobs(self) -> int | None:
        """The engine's ``logprobs``: the top ``top_logprobs`` (0: only the chosen token's) when asked."""
        return (self.top_logprobs or 0) if self.logprobs else None


# What each field accepts, for the 400 message when a value matches none of a union's types.
FIELD_HINTS = {
    "prompt": "a string, a list of strings, a list of token ids, or a list of token-id lists",
    "stop": "a string or a list of strings",
    "messages": "a non-empty list of {role, content} objects",
    "content": 'a string or a list of {"type": "text", "text": ...} parts',
}

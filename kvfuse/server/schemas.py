"""Request bodies (pydantic, at the HTTP boundary only). Unknown OpenAI parameters are accepted and ignored."""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

MODES = ("full", "prefix", "reuse", "blend", "legolink")


class InputDocument(BaseModel):
    """A chunk fused with blend: its cache is computed the first time it is seen and reused afterwards."""

    id: str | None = None
    text: str = Field(min_length=1)


class KvfuseOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    mode: Literal["full", "prefix", "reuse", "blend", "legolink"] | None = None
    ratio: float | Literal["auto"] | None = None
    group: str | None = None  # which of the caller's groups reads the knowledge base
    quote: bool = False  # ask the model for a verbatim quote and verify it (a second, cached request)

    @field_validator("ratio")
    @classmethod
    def _ratio(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float | int) and not 0.0 <= v <= 1.0:
            raise ValueError("ratio must be between 0 and 1, or 'auto'")
        return v


class StreamOptions(BaseModel):
    include_usage: bool = False


class _Common(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float = Field(default=1.0, ge=0.0, le=2.0)
    top_p: float = Field(default=1.0, gt=0.0, le=1.0)
    n: int = Field(default=1, ge=1, le=1, description="only n=1 is supported")
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None
    documents: list[InputDocument] | None = None
    kb: str | None = None
    kvfuse: KvfuseOptions | None = None

    @field_validator("stop")
    @classmethod
    def _stop(cls, v: str | list[str] | None) -> str | list[str] | None:
        if isinstance(v, list) and len(v) > 4:
            raise ValueError("at most 4 stop sequences")
        return v

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        return [self.stop] if isinstance(self.stop, str) else [s for s in self.stop if s]


class CompletionRequest(_Common):
    prompt: str | list[str] | list[int] = Field(description="one prompt: a string, a list of one string, or token ids")


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: str = "text"
    text: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)


class DocumentUpsert(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=128)
    text: str = Field(min_length=1)
    title: str | None = None
    stability: int | None = None
    groups: list[str] | None = None
    shared: bool | None = None

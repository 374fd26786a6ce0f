"""Request bodies (pydantic, at the HTTP boundary only). Unknown OpenAI parameters are accepted and
ignored; known ones that would change the output and are not implemented are refused (`unsupported`).
Every string must be valid Unicode: JSON can carry a lone surrogate (`"\\ud800"`), which no tokenizer
takes, so it is refused here with a 400 that says where it is."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from kvfuse.fuse.registry import modes

MAX_CHARS = 400_000  # per text field: far past any model window, but bounded before tokenising


def valid_unicode(v: Any) -> Any:
    """v, if every string in it (in lists and dicts too) is valid Unicode; else a ValueError saying where."""
    if isinstance(v, str):
        try:
            v.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(f"the text has a lone surrogate (U+{ord(v[e.start]):04X}) at character {e.start}; "
                             "send valid Unicode") from None
    elif isinstance(v, list | tuple):
        for x in v:
            valid_unicode(x)
    elif isinstance(v, dict):
        for k, x in v.items():
            valid_unicode(k)
            valid_unicode(x)
    return v


class Body(BaseModel):
    """A request body or a part of one: every field's strings are checked (`valid_unicode`), and its
    types are strict, as OpenAI's API: "5" is not an integer, "yes" not a boolean (an integer is a number)."""

    model_config = ConfigDict(strict=True)

    @field_validator("*", mode="after")
    @classmethod
    def _unicode(cls, v: Any) -> Any:
        return valid_unicode(v)


class InputDocument(Body):
    """A chunk fused into the request (the default mode, or kvfuse.mode): its cache is computed the first
    time it is seen and reused afterwards."""

    id: str | None = None
    text: str = Field(min_length=1, max_length=MAX_CHARS)


if TYPE_CHECKING:
    ModeName = str
else:
    ModeName = Literal[modes()]  # the registered fusers, read when the schema is built


class KvfuseOptions(Body):
    model_config = ConfigDict(extra="forbid")

    mode: ModeName | None = None  # a registered fuser (kvfuse.fuse.FUSERS)
    ratio: float | Literal["auto"] | None = None
    group: str | None = None  # which of the caller's groups reads the knowledge base
    quote: bool = False  # ask the model for a verbatim quote and verify it (a second, cached request)
    # with a kb: the question the prompt asks, for the citations and conflicts; the answer is then read
    # as `kvfuse ask` reads it (a newline before its first visible character is a lead-in, not a stop)
    question: str | None = Field(default=None, max_length=4096)

    @field_validator("ratio")
    @classmethod
    def _ratio(cls, v: float | str | None) -> float | str | None:
        if isinstance(v, float | int) and not 0.0 <= v <= 1.0:
            raise ValueError("ratio must be between 0 and 1, or 'auto'")
        return v


class StreamOptions(Body):
    include_usage: bool = False


class _Common(Body):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0, description="default 1.0")
    top_p: float | None = Field(default=None, gt=0.0, le=1.0, description="default 1.0")
    n: int | None = Field(default=None, ge=1, le=1, description="only n=1 is supported")
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = Field(default=None, ge=0, le=2**63 - 1)
    user: str | None = None
    documents: list[InputDocument] | None = Field(default=None, max_length=1024)
    kb: str | None = Field(default=None, max_length=128)
    kvfuse: KvfuseOptions | None = None
    # chat: true or false, with top_logprobs 0..20; completions: the number of alternatives, 0..20
    # (checked with a message in `server.logprobs.count`)
    logprobs: bool | int | None = None
    top_logprobs: int | None = None
    # accepted for compatibility, refused when they would change the output (see unsupported())
    echo: bool | None = None
    best_of: int | None = None
    suffix: str | None = None
    tools: list[dict] | None = None  # type: ignore[type-arg]
    response_format: dict | None = None  # type: ignore[type-arg]  # text, json_object, json_schema (server.grammar)
    logit_bias: dict[str, float] | None = Field(default=None, max_length=1024,
                                                description="token id (as a string) -> bias, from -100 to 100")
    presence_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(default=None, ge=-2.0, le=2.0)

    def unsupported(self) -> str | None:
        """The first parameter given that this server cannot honour, if any."""
        if self.echo:
            return "echo"
        if self.best_of is not None and self.best_of > 1:
            return "best_of"
        if self.suffix:
            return "suffix"
        if self.tools:
            return "tools"
        return None

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for k, b in (v or {}).items():
            if not k.isascii() or not k.isdigit():
                raise ValueError(f"logit_bias keys are token ids written as strings, like \"1234\", not {k[:20]!r}")
            if not -100.0 <= b <= 100.0:
                raise ValueError(f"logit_bias values must be between -100 and 100, got {b} for {k}")
        return v

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
    prompt: str | list[str] | list[int] = Field(description="one prompt: a string, a list of one string, or token ids",
                                                max_length=MAX_CHARS)


class ContentPart(Body):
    model_config = ConfigDict(extra="ignore")

    type: str = "text"
    text: str | None = Field(default=None, max_length=MAX_CHARS)


class ChatMessage(Body):
    model_config = ConfigDict(extra="ignore")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = Field(default=None, max_length=MAX_CHARS)

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text or "" for p in self.content if p.type == "text")


class ChatCompletionRequest(_Common):
    messages: list[ChatMessage] = Field(min_length=1, max_length=4096)
    max_completion_tokens: int | None = Field(default=None, ge=1)

    def unsupported(self) -> str | None:
        for m in self.messages:  # only text is read: an image would be silently dropped
            if isinstance(m.content, list) and any(p.type != "text" for p in m.content):
                return "messages[].content[].type=" + ",".join(sorted({p.type for p in m.content if p.type != "text"}))
        return super().unsupported()


class DocumentUpsert(Body):
    model_config = ConfigDict(extra="forbid")

    id: str = Field(min_length=1, max_length=128)
    text: str = Field(min_length=1, max_length=MAX_CHARS)
    title: str | None = Field(default=None, max_length=512)
    stability: int | None = None
    groups: list[str] | None = None
    shared: bool | None = None

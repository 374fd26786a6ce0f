"""Chat templates, tokenised turn by turn, so a conversation's request N is a token prefix of request
N+1: an assistant turn starts with exactly the ids that asked for it.

A template is chosen by the model's family (`CHAT_TEMPLATES`, keyed by the config's model_type); a
family without one uses the checkpoint's own Jinja template where it ships one (its turn markers are
read off a rendered probe conversation, and used only if rendering turn by turn reproduces it), and
plain "Role:" lines otherwise. The system (and developer) message becomes its own turn where the
template has one; nothing is dropped or rewritten in earlier turns (the Qwen3 template strips earlier
reasoning, which breaks the prefix property).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol


class ChatTokenizer(Protocol):
    def encode(self, text: str) -> list[int]: ...  # text: a control token's spelling stays characters

    def encode_markup(self, markup: str) -> list[int]: ...  # the template's own markup: control tokens


class JinjaTokenizer(Protocol):
    @property
    def chat_template(self) -> str | None: ...

    def render_chat(self, messages: Sequence[dict[str, str]], add_generation_prompt: bool = False) -> str: ...


@dataclass(frozen=True, slots=True)
class ChatTemplate:
    open_turn: str = "<start_of_turn>{role}\n"
    close_turn: str = "<end_of_turn>\n"
    assistant_role: str = "model"
    stop_marker: str | None = "<end_of_turn>"
    stop_strings: tuple[str, ...] = ()  # where a reply ends when the model has no end-of-turn token
    system_turns: bool = False  # False: system text opens the first user turn (Gemma has no system role)
    content_prefix: str = ""  # between a turn's opening and its text
    capitalize_roles: bool = False
    developer_as_system: bool = False  # a developer message is rendered as a system turn (Jinja templates)

    @classmethod
    def for_model(cls, model_type: str, tok: object) -> ChatTemplate:
        """The family's template, else the checkpoint's own (where it has one), else plain lines."""
        if model_type in CHAT_TEMPLATES:
            return CHAT_TEMPLATES[model_type]
        jinja = from_jinja(tok) if getattr(tok, "chat_template", None) else None
        return jinja if jinja is not None else PLAIN

    def role(self, role: str) -> str:
        if role == "assistant":
            return self.assistant_role
        return role.capitalize() if self.capitalize_roles else role

    def turns(self, tok: ChatTokenizer, messages: Sequence[tuple[str, str]]) -> list[int]:
        """The ids of finished turns (role, content), in order."""
        ids: list[int] = []
        pending: list[str] = []  # system text waiting for the next user turn
        for role, content in messages:
            if role in ("system", "developer") and not self.system_turns:
                pending.append(content)
                continue
            if role == "developer" and self.developer_as_system:
                role = "system"
            if role == "user" and pending:
                content = "\n\n".join(pending + [content])
                pending = []
            ids += self.generation_prompt(tok, role) + tok.encode(self.content_prefix + content)
            ids += tok.encode_markup(self.close_turn)
        if pending:  # system text and no user turn after it: a user turn of its own
            ids += self.generation_prompt(tok, "user") + tok.encode(self.content_prefix + "\n\n".join(pending))
            ids += tok.encode_markup(self.close_turn)
        return ids

    def generation_prompt(self, tok: ChatTokenizer, role: str = "assistant") -> list[int]:
        return list(tok.encode_markup(self.open_turn.format(role=self.role(role))))

    def render(self, messages: Sequence[tuple[str, str]]) -> str:
        """The text `turns` tokenises (system turns as their own, as the Jinja probe renders them)."""
        out = ""
        for role, content in messages:
            out += self.open_turn.format(role=self.role(role)) + self.content_prefix + content + self.close_turn
        return out


GEMMA = ChatTemplate()
PLAIN = ChatTemplate(open_turn="{role}:", close_turn="\n", assistant_role="Assistant", stop_marker=None,
                     stop_strings=("\nUser:",), system_turns=True, content_prefix=" ", capitalize_roles=True)
CHAT_TEMPLATES: dict[str, ChatTemplate] = {"gemma3_text": GEMMA}

_PROBE = ("\x1eS\x1e", "\x1eU1\x1e", "\x1eA1\x1e", "\x1eU2\x1e")


def from_jinja(tok: object) -> ChatTemplate | None:
    """Turn markers read off the checkpoint's Jinja template; None when it is not a plain per-turn layout."""
    render = getattr(tok, "render_chat", None)
    if render is None:
        return None
    roles = ("system", "user", "assistant", "user")
    msgs = [{"role": r, "content": c} for r, c in zip(roles, _PROBE, strict=True)]
    try:
        text = str(render(msgs))
        with_gen = str(render(msgs, True))
    except Exception:  # a template that refuses the probe (no system role, say): not a plain layout
        return None
    pieces, rest = [], text
    for sentinel in _PROBE:
        before, found, rest = rest.partition(sentinel)
        if not found:
            return None
        pieces.append(before)
    close = rest
    opens = [pieces[0]] + [p[len(close):] for p in pieces[1:] if p.startswith(close)]
    if len(opens) != 4 or not close or "user" not in opens[1] or not with_gen.startswith(text):
        return None
    open_turn = opens[1].replace("user", "{role}", 1)
    start = opens[0].rfind(open_turn.format(role="system"))  # anything before it (a BOS text) is not a turn
    if start < 0 or open_turn.format(role="assistant") != opens[2]:
        return None
    gen = with_gen[len(text):]
    marker = close.strip()
    t = ChatTemplate(open_turn=open_turn, close_turn=close, assistant_role="assistant",
                     stop_marker=marker or None, stop_strings=() if marker else ("\nuser",), system_turns=True,
                     developer_as_system=True)
    probe = list(zip(roles, _PROBE, strict=True))
    if t.render(probe) != text[start:] or gen != t.open_turn.format(role="assistant"):
        return None  # turn-by-turn rendering would not reproduce the checkpoint's own
    return t

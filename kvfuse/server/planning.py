"""Turning a completion or chat body into a planned engine request, on the HTTP thread: every check that
can fail is made here, so a bad request is a 4xx before it queues. Knowledge-base requests are planned
by the same `kb.answer.prepare` as `kvfuse ask`."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from kvfuse.engine.sampling import SamplingParams
from kvfuse.fuse import default_mode
from kvfuse.kb import answer
from kvfuse.kb.base import KnowledgeBase
from kvfuse.kb.manifest import KBError
from kvfuse.request import ModeUnavailableError, Ratio, Request, RequestError, owned_request
from kvfuse.server import logprobs as lp
from kvfuse.server.auth import Principal
from kvfuse.server.errors import ApiError
from kvfuse.server.schemas import ChatCompletionRequest, CompletionRequest, KvfuseOptions
from kvfuse.server.state import ServerState
from kvfuse.text.layout import bos, chunk_text

CHAT_DEFAULT_MAX_TOKENS = 256
COMPLETION_DEFAULT_MAX_TOKENS = 16


@dataclass
class Planned:
    request: Request
    mode: str
    ratio: Ratio
    params: SamplingParams
    stops: list[str]
    opts: KvfuseOptions
    question: str
    kb: KnowledgeBase | None = None
    prep: answer.Prepared | None = None  # the knowledge-base plan it was prepared on
    built: int = 0  # knowledge-base prefix tokens computed for this request (a cold build before it)
    build_s: float = 0.0
    arrived: float = field(default_factory=time.perf_counter)  # when the request reached the server
    grammar: Any = None  # response_format's `server.grammar.Grammar` (a sampling.TokenConstraint), if any


def group_for(kb: KnowledgeBase, principal: Principal, wanted: str | None) -> str:
    allowed = principal.groups_for(kb.name)
    group = wanted or (allowed[0] if allowed else kb.default_group())
    if allowed is not None and group not in allowed:
        raise ApiError(403, f"This key may read {kb.name!r} only as {', '.join(allowed)}, not as {group!r}.",
                       "permission_error", param="kvfuse.group", code="group_not_allowed")
    if group not in kb.manifest.groups:
        raise ApiError(400, f"{kb.name!r} has no group {group!r}; its groups are {', '.join(kb.manifest.groups)}.",
                       param="kvfuse.group")
    return group


def plan_request(state: ServerState, body: CompletionRequest | ChatCompletionRequest, principal: Principal,
                 chat: bool) -> Planned:
    eng, tok = state.engine, state.tok
    bad = body.unsupported()
    if bad is not None:
        raise ApiError(400, f"The parameter {bad!r} is not supported by this server; remove it.", param=bad,
                       code="unsupported_parameter")
    if body.model is not None and body.model != state.model_id:
        raise ApiError(404, f"The model {body.model!r} does not exist; this server serves {state.model_id!r}.",
                       param="model", code="model_not_found")
    docs = [d.text for d in body.documents or []]
    lim = state.limits
    if len(docs) > lim.max_documents:
        raise ApiError(400, f"{len(docs)} documents given, but at most {lim.max_documents} are allowed per request; "
                            "send fewer.", param="documents", code="too_many_documents")
    chunks = tuple(tuple(tok.encode(chunk_text(d))) for d in docs)
    for i, c in enumerate(chunks):
        if len(c) > lim.max_document_tokens:
            raise ApiError(400, f"documents[{i}] has {len(c)} tokens, but at most {lim.max_document_tokens} are "
                                "allowed; split it into smaller documents.", param=f"documents[{i}]",
                           code="document_too_large")
    opts = body.kvfuse or KvfuseOptions()
    kb = group = None
    head: list[int] = bos(tok)
    if body.kb is not None:
        kb = state.kb_for(body.kb, principal)
        group = group_for(kb, principal, opts.group)
        try:
            head = list(kb.plan(group, principal.tenant).ids)
        except KBError as e:
            raise ApiError(400, str(e), param="kb") from None
    elif opts.group is not None:
        raise ApiError(400, "kvfuse.group applies only with a kb.", param="kvfuse.group")
    elif opts.question is not None:
        raise ApiError(400, "kvfuse.question applies only with a kb.", param="kvfuse.question")
    stop_ids = list(eng.cfg.eos_token_ids)
    if chat:
        assert isinstance(body, ChatCompletionRequest)
        msgs = [(m.role, m.text()) for m in body.messages]
        turns = state.chat.turns(tok, msgs)
        gen = state.chat.generation_prompt(tok)
        # the conversation follows the fused documents; without them it is a cacheable prefix (turn N+1 reuses N)
        after, suffix = ([], turns + gen) if chunks else (turns, gen)
        if state.chat.stop_marker:
            stop_ids += [t for t in tok.encode_markup(state.chat.stop_marker)][:1]
        question = msgs[-1][1]
        default_max = CHAT_DEFAULT_MAX_TOKENS
    else:
        assert isinstance(body, CompletionRequest)
        ids, question = _prompt_ids(body, tok)
        after, suffix = ([], ids) if chunks else (ids[:-1], ids[-1:])  # automatic prefix caching of the prompt
        default_max = COMPLETION_DEFAULT_MAX_TOKENS
    if opts.question is not None:  # the question the prompt asks: what the citations and conflicts read
        question = opts.question
    mode = default_mode(opts.mode, bool(chunks))
    if opts.ratio is not None and not eng.fuser(mode).takes_ratio:
        raise ApiError(400, f"kvfuse.ratio applies only to mode 'blend' (or another mode that recomputes a share "
                            f"of the chunks), not {mode!r}.", param="kvfuse.ratio")
    prompt = len(head) + len(after) + sum(len(c) for c in chunks) + len(suffix)
    window = eng.cfg.max_position_embeddings
    asked = (body.max_completion_tokens if isinstance(body, ChatCompletionRequest) else None) or body.max_tokens
    max_tokens = asked or max(1, min(default_max, window - prompt))
    if prompt + max_tokens > window:
        raise ApiError(400, f"This model's maximum context length is {window} tokens. However, you requested "
                            f"{prompt + max_tokens} tokens ({prompt} in the prompt, {max_tokens} for the "
                            "completion). Please shorten the prompt or documents, or lower max_tokens.",
                       param="messages" if chat else "prompt", code="context_length_exceeded")
    prep = None
    try:
        if kb is not None and group is not None:
            prep = answer.prepare(kb, question, group, principal.tenant, (), opts.ratio, suffix=suffix,
                                  after_prefix=after, documents=chunks, mode=mode, tenant_wide=principal.tenant_wide)
            req = prep.request
        else:
            # everything after BOS is the tenant's and group's own: salted so
            req = owned_request(head, suffix, after=after, chunks=chunks, owner=principal.salt())
        eng.validate(req, mode, opts.ratio, max_tokens)
        try:
            logprobs = lp.count(body.logprobs, body.top_logprobs, chat)
        except ValueError as e:
            raise ApiError(400, str(e), param="top_logprobs" if chat else "logprobs", code="invalid_logprobs") from None
        params = SamplingParams(max_tokens=max_tokens, logprobs=logprobs,
                                temperature=1.0 if body.temperature is None else body.temperature,
                                top_p=1.0 if body.top_p is None else body.top_p, seed=body.seed,
                                stop_token_ids=tuple(stop_ids), logit_bias=_bias(body, eng.cfg.vocab_size),
                                presence_penalty=body.presence_penalty or 0.0,
                                frequency_penalty=body.frequency_penalty or 0.0)
    except (RequestError, ModeUnavailableError, KBError, ValueError) as e:
        raise ApiError(400, str(e), param="kvfuse") from None
    if opts.quote and (kb is None or not question.strip()):
        raise ApiError(400, "kvfuse.quote needs a kb and a text question.", param="kvfuse.quote")
    stops = body.stops() + (list(state.chat.stop_strings) if chat else [])
    return Planned(req, mode, opts.ratio, params, stops, opts, question, kb, prep, grammar=_grammar(state, body))


def _grammar(state: ServerState, body: CompletionRequest | ChatCompletionRequest) -> Any:
    """The response_format's grammar over this model's tokens, or None for plain text; a 400 that says
    what is wrong."""
    from kvfuse.server.grammar import Grammar, grammar_for

    try:
        grammar = grammar_for(body.response_format)
        if grammar is None:
            return None
        hf = getattr(state.tok, "hf", None)
        if hf is None:
            raise ValueError("this server's tokenizer cannot compile a grammar; response_format needs an HF one")
        return Grammar(hf, grammar)
    except ValueError as e:
        raise ApiError(400, str(e), param="response_format", code="invalid_response_format") from None


def _bias(body: CompletionRequest | ChatCompletionRequest, vocab: int) -> tuple[tuple[int, float], ...]:
    out = tuple(sorted((int(k), float(b)) for k, b in (body.logit_bias or {}).items()))
    bad = [t for t, _ in out if t >= vocab]
    if bad:
        raise ApiError(400, f"logit_bias names token ids {bad[:5]} outside this model's vocabulary of {vocab}.",
                       param="logit_bias", code="invalid_logit_bias")
    return out


def _prompt_ids(body: CompletionRequest, tok: object) -> tuple[list[int], str]:
    """The prompt's ids and its text (empty for a prompt given as token ids)."""
    p = body.prompt
    if isinstance(p, list) and p and all(isinstance(x, str) for x in p):
        if len(p) != 1:
            raise ApiError(400, f"{len(p)} prompts given; this server takes one prompt per request.", param="prompt")
    text_prompt = p if isinstance(p, str) else (str(p[0]) if p and isinstance(p[0], str) else None)
    if text_prompt is not None:
        ids: list[int] = tok.encode(text_prompt)  # type: ignore[attr-defined]
        question = text_prompt
    else:
        ids = [int(x) for x in p]
        question = ""
    if not ids:
        raise ApiError(400, "The prompt is empty; send some text.", param="prompt")
    return ids, question

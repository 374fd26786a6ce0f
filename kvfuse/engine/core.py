"""The engine: build a request's KV cache with a registered fuser, then decode. Token ids only.

A request (`request.Request`) is  prefix | chunks | suffix; a fuser (`fuse.FUSERS`: full, prefix,
reuse, blend, legolink, ...) says which caches it reads. The engine validates a request once, builds
its cache (`CacheManager` for keys, lookups and stores), picks the first token, runs the request's
store writes, and then moves running requests on together (`begin` / `advance` / `Decoding.close`).

TTFT is measured here, from the moment a request enters `begin` to the moment its first token is
chosen; it covers cache lookups, loads, any chunk computed on a miss, fusion and sampling.
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Generator, Mapping, Sequence
from pathlib import Path
from typing import Any, TypeVar, cast

import torch

from kvfuse import fuse
from kvfuse.drafts import DRAFT_TOKENS
from kvfuse.engine.cache import CacheManager
from kvfuse.engine.decode import Decoding, Prefilled, Slot, TokenStream, step_hidden
from kvfuse.engine.lmhead import GreedyHead
from kvfuse.engine.sampling import SamplingParams, TokenConstraint, logprob_of, masked
from kvfuse.engine.scheduler import Scheduler
from kvfuse.engine.selfcheck import check_fusion
from kvfuse.fuse import FuseContext, FuseLayout, Fuser
from kvfuse.loader import LayerSource
from kvfuse.model import Decoder
from kvfuse.policy import Controller, Decision
from kvfuse.request import Generation, ModeUnavailableError, Ratio, Request, RequestError, TokenCounts
from kvfuse.rope import rerotate_into
from kvfuse.store.base import Remote
from kvfuse.store.tiered import TieredStore

log = logging.getLogger(__name__)
SCREENED = ("fp32", "bf16", "groups")  # precisions whose LM head is float32: greedy steps screen it
DECODES = ("none", "few", "many")  # how much a loaded engine will decode (`Engine.load`)
F = TypeVar("F", bound=Callable[..., Any])


class _NotKept(Exception):
    """A failed self-check, which is not kept."""


def on_model_device(fn: F) -> F:
    """Run an Engine method with the model's device as the default for new tensors (`torch.device` as a
    context), so that the engine's code names no device. On the CPU nothing is entered: the mode costs
    a Python call per torch op, which a decoding step on a CPU would feel."""

    @functools.wraps(fn)
    def run(self: Engine, *args: Any, **kwargs: Any) -> Any:
        device = self.model.device
        if device.type == "cpu":
            return fn(self, *args, **kwargs)
        with device:
            return fn(self, *args, **kwargs)

    return cast(F, run)

BLOCK_SIZE = 16
Mode = str | Fuser  # a registered fuser's name, or a fuser with its own options (Legolink(head_tokens=8))


class Engine:
    def __init__(
        self,
        model: Decoder,
        fingerprint: str,
        store: TieredStore | None = None,
        preamble: Sequence[int] | None = None,
        block_size: int = BLOCK_SIZE,
        kv_dtype: torch.dtype | None = None,
        self_check: bool = True,
        rotate: fuse.Rerotate = rerotate_into,
        greedy_screen: bool = True,
        draft_tokens: int = DRAFT_TOKENS,
    ) -> None:
        self.model, self.cfg, self.fingerprint = model, model.cfg, fingerprint
        bos = self.cfg.bos_token_id
        default_preamble = (bos,) if bos is not None else ()
        self.preamble: tuple[int, ...] = tuple(preamble) if preamble is not None else default_preamble
        kv = kv_dtype if kv_dtype is not None else model.kv_dtype  # by default, what holds the KV exactly
        self.cache = CacheManager(model, fingerprint, store if store is not None else TieredStore(), self.preamble,
                                  block_size, kv)
        self.pipelined = True  # read later-tier chunk layers ahead of the recompute
        self.controller: Controller | None = None  # set one to enable ratio "auto" and decisions
        self._rotate = rotate
        # decoding: the first token, drafts from the context, batched steps (`scheduler.py`); the int8
        # screen's bound is for a float32 head on the CPU (fp32's, bf16's and groups'; int8's head is int8)
        self.scheduler = Scheduler(model, lambda: self.precision in SCREENED and model.device.type == "cpu",
                                   greedy_screen, draft_tokens)
        self.blend_error: str | None = self._self_check() if self_check else None
        if self.blend_error:
            log.warning("%s", self.blend_error)

    @on_model_device
    def _self_check(self) -> str | None:
        return check_fusion(self.model, self.preamble, self._rotate)

    def _kept_self_check(self) -> str | None:
        """`_self_check`'s answer for a model loaded from a checkpoint: where it passed before for this
        fingerprint, preamble, software and machine (kept in the cache dir, as the batch check's), it is
        not run again (on a 1B model it is a few forward passes: seconds of every start); a failure is
        never kept, so its message is always the model's own."""
        import hashlib

        from kvfuse.checkpoints import kept_check
        from kvfuse.defaults import cpu_flags

        parts = (self.fingerprint, tuple(self.preamble), torch.__version__, sorted(cpu_flags()), self.model.device.type)
        key = hashlib.sha256(repr(parts).encode()).hexdigest()[:24]
        found: list[str | None] = []

        def run() -> int:
            found.append(self._self_check())
            if found[0] is not None:
                raise _NotKept
            return 1

        try:
            kept_check("self-checks", key, run)
        except _NotKept:
            pass
        return found[0] if found else None

    @classmethod
    def load(
        cls, path: str | Path | None = None, store_dir: str | Path | None = None, precision: str = "fp32",
        capacity: Mapping[str, int] | None = None, remote: Remote | None = None, device: str = "cpu",
        decodes: str = "many", **kwargs: object
    ) -> Engine:
        """Load a checkpoint (default: Gemma 3 270M) at a precision (`precision.PRECISIONS`) on a device
        (the CPU, or an accelerator such as "cuda": the engine computes there, the store stays in host
        memory and on disk), open its store (memory, plus disk at store_dir, plus a shared Redis at
        `remote`; `capacity`: bytes per tier name), run the self-check, key its drafts by the
        checkpoint's vocabulary (`drafts.token_keys`) and build its greedy screen (`lmhead.GreedyHead`).
        `decodes` says how much it will decode (`DECODES`): "many" (a server, an eval) builds the screen
        on the kernel that steps fastest here; "few" (a command that answers a question or two and
        exits) on one that builds in a fifth of the time (`lmhead.BRIEF_SCREEN`: 2 s less on Gemma 3,
        4-8 ms more a step); "none" (building a knowledge base's caches) skips the keys and the screen
        (on Gemma 3 about 3 s, and 2 s more where its keys are not yet kept: `vocab_keys`); should it
        decode after all, its screen is built at first use and its drafts match tokens as they are."""
        from kvfuse.checkpoints import resolve_model_path, vocab_keys
        from kvfuse.drafts import cover
        from kvfuse.engine.lmhead import BRIEF_SCREEN
        from kvfuse.store import open_store
        from kvfuse.weights import check_device, load_model

        if decodes not in DECODES:
            raise ValueError(f"decodes must be one of {', '.join(DECODES)}, got {decodes!r}")

        # drafts match a token with or without its leading space, where they run (`Scheduler.drafts_pay`):
        # the keys are read before the weights (kept beside tokenizer.json after the first load; where
        # they are made, `vocab_keys` hands back the heap that reading the spellings took)
        keys = None
        if decodes != "none" and precision in SCREENED and check_device(device, precision).type == "cpu":
            keys = vocab_keys(resolve_model_path(path))
        loaded = load_model(path, precision, device)
        store = open_store(store_dir, loaded.fingerprint, capacity=capacity, remote=remote)
        check = bool(kwargs.pop("self_check", True))
        engine = cls(loaded.model, loaded.fingerprint, store=store, self_check=False, **kwargs)  # type: ignore[arg-type]
        if check:  # a checkpoint's model: the check's answer is kept per model, software and machine
            engine.blend_error = engine._kept_self_check()
            if engine.blend_error:
                log.warning("%s", engine.blend_error)
        engine.scheduler.draft_keys = None if keys is None else cover(keys, engine.cfg.vocab_size)
        engine.scheduler.screen_kernel = BRIEF_SCREEN if decodes == "few" else None
        engine.scheduler.batch_key = loaded.fingerprint  # the batch check's answer is kept per model (and machine)
        # the greedy screen now, not in the first request's first step: that request would wait for it
        # (about 3 s on Gemma 3), and its temporaries (about 0.6 GB) would come on top of the caches
        if decodes != "none":
            engine.greedy_head()
        return engine

    @property
    def precision(self) -> str:
        """fp32, bf16 or int8 (`precision.PRECISIONS`): what the model computes in."""
        from kvfuse.precision import of

        return of(self.model)

    @property
    def block_size(self) -> int:
        return self.cache.block_size

    @property
    def kv_dtype(self) -> torch.dtype:
        return self.cache.kv_dtype

    @property
    def store(self) -> TieredStore:
        return self.cache.store

    @store.setter
    def store(self, store: TieredStore) -> None:
        self.cache.store = store

    def fuser(self, mode: Mode) -> Fuser:
        """The fuser a mode names, with its model-dependent options settled for this model (`fuse.for_model`)."""
        try:
            return fuse.for_model(fuse.get_fuser(mode), self.model.cfg)
        except KeyError:
            raise RequestError(f"unknown mode {mode!r}; choose one of {', '.join(fuse.modes())}") from None
        except ValueError as e:  # an option this model cannot take (a skip past its last layer)
            raise RequestError(str(e)) from None

    def validate(self, req: Request, mode: Mode, ratio: Ratio = None, max_tokens: int = 0) -> Fuser:
        """Check a request before any work; returns its fuser."""
        fuser = self.fuser(mode)
        if not fuser.exact and self.blend_error:
            raise ModeUnavailableError(self.blend_error)
        if not req.suffix:
            raise RequestError("the request needs a non-empty suffix (the question)")
        if any(len(c) == 0 for c in req.chunks):
            raise RequestError("empty chunks are not allowed; drop them from the request")
        if ratio == "auto":
            if self.controller is None:
                raise RequestError("ratio 'auto' needs the loading controller's profile (run `kvfuse profile`)")
        elif ratio is not None and not (isinstance(ratio, int | float) and 0.0 <= ratio <= 1.0):
            raise RequestError(f"ratio must be a number between 0 and 1 or 'auto', got {ratio!r}")
        self.check_window(len(req), max_tokens)
        bad = [t for t in req.ids if not 0 <= t < self.cfg.vocab_size]
        if bad:
            raise RequestError(f"token ids {bad[:5]} are outside the vocabulary of {self.cfg.vocab_size}")
        return fuser

    def check_window(self, prompt: int, max_tokens: int = 0) -> None:
        """The one context-window check: a prompt of that many tokens, and max_tokens more, must fit."""
        limit = self.cfg.max_position_embeddings
        if prompt + max_tokens > limit:
            raise RequestError(
                f"the prompt has {prompt} tokens and asks for {max_tokens} more, but the model's context "
                f"window is {limit} tokens; shorten the context or lower max_tokens"
            )

    @on_model_device
    def precompute(self, req: Request, mode: Mode, pin: bool = False) -> float:
        """Prepare the caches that `mode` reads for this request; returns the seconds spent."""
        with torch.inference_mode():
            return self.cache.precompute(req, self.fuser(mode), pin)

    # -- prefill -----------------------------------------------------------------------------------

    @on_model_device
    @torch.inference_mode()
    def prefill(self, req: Request, mode: Mode = "full", ratio: Ratio = None, room: int = 0) -> Prefilled:
        """Build the request's KV cache and the last prompt token's hidden state (`Fused.logits` gives
        the first token's logits); `room` reserves buffer space for that many decoded tokens, so
        decoding appends in place."""
        return self._prefill(req, self.validate(req, mode, ratio), ratio, room)

    def _prefill(self, req: Request, fuser: Fuser, ratio: Ratio, room: int, pause: fuse.Pause = fuse.no_pause
                 ) -> Prefilled:
        counts, suffix = TokenCounts(prompt=len(req)), torch.tensor(req.suffix, dtype=torch.int64)
        ctx = FuseContext(self._rotate, None, room, pause)
        # the modes that read no chunk caches lay the chunks out as part of the prefix
        cacheable = list(req.prefix) + [t for c in req.chunks for t in c] if fuser.reads != "chunks" else []
        if fuser.reads == "nothing":
            fused = fuser.fuse(self.model, FuseLayout.of(None, (), suffix, prefix_tail=_ids(cacheable)), None, ctx)
            counts.prefilled = len(req)
            return Prefilled(fused, counts, fuser.name, None, fuser=fuse.spec_of(fuser))
        if fuser.reads == "prefix":
            keys = self.cache.request_keys(req, fuser)
            hit = self.cache.read_prefix(keys.blocks)
            n_full = len(keys.blocks) * self.block_size
            stored_tail = self.cache.read_tail(keys.tail, len(cacheable) - n_full) if len(hit) == len(keys.blocks) \
                else None
            parts = hit + [stored_tail] if stored_tail is not None else hit  # the full blocks, then the tail
            n_hit = sum(len(c) for c in parts)
            fused = fuser.fuse(self.model, FuseLayout.of(parts, (), suffix, prefix_tail=_ids(cacheable[n_hit:])),
                               None, ctx)
            counts.reused, counts.prefilled, counts.cached = n_hit, len(req) - n_hit, n_hit
            stores: list[Callable[[], object]] = [
                lambda: self.cache.store_prefix(keys.blocks, fused.cache),
                lambda: self.cache.store_tail(keys.tail, fused.cache, n_full, len(cacheable))]
            return Prefilled(fused, counts, fuser.name, None, stores, fuser=fuse.spec_of(fuser))
        # the fusing modes: stored prefix blocks, the prefix's uncached tail computed with the suffix
        keys = self.cache.request_keys(req, fuser)
        hit = self.cache.read_prefix(keys.blocks)
        n_hit = len(hit) * self.block_size
        tail, ids = _ids(req.prefix[n_hit:]), [_ids(c) for c in req.chunks]
        counts.reused = n_hit + req.chunk_tokens
        counts.prefilled = len(req) - counts.reused
        chunks = self.cache.open_chunks(req, keys, pause)
        r, decision = self._ratio(fuser, ratio, counts.reused, chunks.tier)

        def layout(sources: Sequence[LayerSource]) -> FuseLayout:
            return FuseLayout.of(hit, sources, suffix, ids, tail)

        fused, loader = self.cache.fuse(fuser, layout, r, chunks, req, self._rotate, room, self.pipelined, pause)
        counts.recomputed = round(fused.recomputed_token_layers / self.cfg.num_layers)
        stored = chunks.stored_mask()
        recomputed_stored = sum(int(stored[sel].sum()) for sel in fused.selected) / self.cfg.num_layers
        counts.cached = n_hit + int(stored.sum()) - round(recomputed_stored)
        writes: list[Callable[[], object]] = [lambda: self.cache.store_prefix(keys.blocks, fused.cache)]
        return Prefilled(fused, counts, fuser.name, r, writes + self.cache.promotions(chunks, loader), decision,
                         fuse.spec_of(fuser))

    def _ratio(self, fuser: Fuser, ratio: Ratio, reused: int, tier: str) -> tuple[float | None, Decision | None]:
        """The recompute ratio (the controller's, for 'auto') and the controller's decision, if it has one."""
        if not fuser.takes_ratio:
            return None, None
        fixed = None if ratio == "auto" else (fuser.default_ratio if ratio is None else float(ratio))
        if self.controller is None:
            assert fixed is not None  # validate refuses 'auto' without a controller
            return fixed, None
        profiled = self.controller.profile.tiers
        if tier not in profiled:  # a tier the profile has not measured: decide as for the slowest one it has
            tier = min(profiled, key=lambda t: profiled[t].read_bytes_per_s)
        decision = self.controller.decide(reused, tier, fixed, fuse.fuser_key(fuser))
        return decision.ratio, decision

    # -- decoding ----------------------------------------------------------------------------------

    def greedy_head(self) -> GreedyHead | None:
        """The int8 screen of the LM head for exact greedy steps (None: not used); `Engine.load` builds it,
        an engine made otherwise at its first use."""
        return self.scheduler.greedy_head()

    @property
    def draft_tokens(self) -> int:
        """The longest draft from the context a step verifies (0: no drafts; `Scheduler.drafts_pay`)."""
        return self.scheduler.draft_tokens

    @draft_tokens.setter
    def draft_tokens(self, n: int) -> None:
        self.scheduler.draft_tokens = n

    def stream(self, req: Request, mode: Mode = "full", ratio: Ratio = None, params: SamplingParams | None = None,
               *, score: Sequence[int] | None = None, record_logits: bool = False,
               constraint: TokenConstraint | None = None) -> TokenStream:
        """Generate token ids one at a time; the stream's `result` holds timings and counts at the end.

        `score` is a continuation to teacher-force on the same prompt cache after the first token
        (its logits land in `result.scored_logits`; not part of TTFT); `record_logits` keeps the
        logits of every generated step in `result.step_logits`; `constraint` is a grammar (`begin`)."""
        params = params or SamplingParams()
        fuser = self.validate(req, mode, ratio, params.max_tokens)  # fails now, not at the first next()
        return TokenStream(lambda out: self._generate(req, fuser, ratio, params, out, score, record_logits,
                                                      constraint))

    def generate(self, req: Request, mode: Mode = "full", ratio: Ratio = None, params: SamplingParams | None = None,
                 **extras: Any) -> Generation:
        stream = self.stream(req, mode, ratio, params, **extras)
        for _ in stream:
            pass
        assert stream.result is not None
        return stream.result

    def begin(self, req: Request, mode: Mode = "full", ratio: Ratio = None, params: SamplingParams | None = None,
              *, score: Sequence[int] | None = None, record_logits: bool = False,
              pause: fuse.Pause = fuse.no_pause, constraint: TokenConstraint | None = None) -> Decoding:
        """Prefill a request, choose its first token and run its store writes; `advance` then moves it
        (with others) on, and `close()` returns its Generation.

        `pause` is called between pieces of the prefill (`fuse.core`): the server steps its running
        requests there. It changes nothing computed, but its time counts in this request's TTFT.
        `constraint` (a grammar over the tokens) masks what may come next, at every token."""
        params = params or SamplingParams()
        return self._begin(req, self.validate(req, mode, ratio, params.max_tokens), ratio, params, score,
                           record_logits, pause, constraint)

    @on_model_device
    @torch.inference_mode()
    def _begin(self, req: Request, fuser: Fuser, ratio: Ratio, params: SamplingParams,
               score: Sequence[int] | None, record_logits: bool, pause: fuse.Pause = fuse.no_pause,
               constraint: TokenConstraint | None = None) -> Decoding:
        t0 = time.perf_counter()
        before = self.store.stats.snapshot()
        pre = self._prefill(req, fuser, ratio, params.max_tokens, pause)
        store_stats = self.store.stats.since(before)
        gen = torch.Generator().manual_seed(params.seed) if params.seed is not None else None
        stop = set(params.stop_token_ids if params.stop_token_ids is not None else self.cfg.eos_token_ids)
        if params.ignore_eos:
            stop = set()
        first = self.scheduler.first_token(pre, params, gen, record_logits, constraint)
        d = Decoding(pre, params, stop, gen, t0, time.perf_counter() - t0, store_stats, record_logits, constraint)
        if d.logprobs is not None:  # the first token was drawn from the prompt's logits (`first_token`)
            d.logprobs.append(logprob_of(masked(pre.fused.logits, constraint), params, (), first))
        self.scheduler.open(d, req.ids)
        for write in pre.writeback:  # now, not at the end: a request started next finds what this one stored,
            write()  # whether this one is still decoding or not
        d.scored = self._score(pre.fused, score) if score else None
        d.take(first)
        return d

    @on_model_device
    @torch.inference_mode()
    def advance(self, batch: Sequence[Decoding]) -> None:
        """Move every unfinished request in the batch on by at least one token (`Scheduler.advance`):
        each gets exactly the tokens it would get stepped alone."""
        self.scheduler.advance(batch)

    @on_model_device
    def decode_batch_limit(self) -> int:
        """How many rows a decoding step carries on this model and machine with every answer unchanged."""
        return self.scheduler.batch_limit()

    def _generate(self, req: Request, fuser: Fuser, ratio: Ratio, params: SamplingParams, out: TokenStream,
                  score: Sequence[int] | None, record_logits: bool,
                  constraint: TokenConstraint | None = None) -> Generator[int, None, None]:
        d = self._begin(req, fuser, ratio, params, score, record_logits, constraint=constraint)
        try:
            sent = 0
            while True:
                while sent < len(d.tokens):
                    sent += 1
                    yield d.tokens[sent - 1]
                if d.error is not None:
                    raise d.error
                if d.done:
                    return
                self.advance([d])
        finally:
            out.result = d.close()

    @on_model_device
    @torch.inference_mode()
    def _score(self, fused: fuse.Fused, ids: Sequence[int]) -> torch.Tensor:
        """Teacher-forced logits (len(ids), vocab): row i predicts ids[i] after the prompt and ids[:i]."""
        slot = Slot(self.model, fused.cache, len(ids))
        rows = [fused.logits] + [self.model.logits(step_hidden(self.model, [slot], [t]))[0] for t in ids[:-1]]
        return torch.stack(rows).float()


def _ids(tokens: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(tokens), dtype=torch.int64)


__all__ = ["Decoding", "Engine", "Generation", "ModeUnavailableError", "Request", "RequestError", "TokenStream"]

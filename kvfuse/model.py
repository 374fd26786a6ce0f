"""A compact decoder for Llama, Mistral, Qwen2, Qwen3 and Gemma 3, with a per-layer API.

Everything works on one unbatched sequence. Shapes:
    h      (T, hidden)         hidden states of T tokens
    q      (heads, T, head_dim)
    k, v   (kv_heads, T, head_dim)   keys are stored already rotated to their positions
    pos    (T,) int64          absolute positions; attention masks are built from positions, so a
                               query may sit anywhere among the keys (that is what blend needs)

A layer is  h = h + attn(norm(h));  h = h + mlp(norm(h))  (Gemma adds a norm after each branch).
It is split into `project` (norm, q/k/v, qk-norm, RoPE), `attend` and `finish` (output projection and
MLP), so a caller can run the attention of a subset of tokens against any set of keys.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from kvfuse.config import ModelConfig, RopeSpec
from kvfuse.groups import GroupEmbedding, GroupLinear, GroupTable
from kvfuse.lowbit import LowBitEmbedding, LowBitLinear, LowBitRows, LowBitTable
from kvfuse.packed import PackedLinear
from kvfuse.quant import Int8Embedding, Int8Linear
from kvfuse.rope import rope_cos_sin, rotate, signed_sin
from kvfuse.w8a8 import W8A8Linear

ATTN_BLOCK = 256  # queries per attention block for long prefills
# (query start, end, first key, key end, mask (e-s, hi-lo)): a boolean mask, or an additive one (0 where a
# query sees a key, -inf elsewhere) in the dtype of a low-precision attention's scores
AttnBlock = tuple[int, int, int, int, torch.Tensor]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, weight_offset: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.full((dim,), 1.0 - weight_offset))  # no arithmetic: see `_normal`
        self.eps, self.offset = eps, weight_offset
        self._scale: tuple[tuple[object, ...], torch.Tensor] | None = None

    def scale(self) -> torch.Tensor:
        """offset + weight in float32, made again only when the weight changes (a decoding step runs
        six norms a layer, and making it was a third of their operator calls)."""
        w = self.weight
        key = (w.data_ptr(), w.device, w.dtype, w._version)
        if self._scale is None or self._scale[0] != key:
            self._scale = (key, self.offset + w.detach().float())
        return self._scale[1]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x / rms(x) * (offset + weight), computed in float32 (one fused kernel)."""
        if x.dtype == torch.float32:
            return F.rms_norm(x, (x.shape[-1],), self.scale(), self.eps)
        return F.rms_norm(x.float(), (x.shape[-1],), self.scale(), self.eps).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * d, cfg.num_kv_heads * d
        # the checkpoint's q, k and v weights stacked (`STACKED`): a decoding step reads them in one product
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=False)
        self.q_norm: RMSNorm | None = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_weight_offset) if cfg.qk_norm else None
        self.k_norm: RMSNorm | None = RMSNorm(d, cfg.rms_norm_eps, cfg.norm_weight_offset) if cfg.qk_norm else None


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.inter = cfg.intermediate_size
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * self.inter, bias=False)  # gate and up stacked
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)
        self.activation = cfg.activation
        self.act = (lambda x: F.gelu(x, approximate="tanh")) if cfg.activation == "gelu_tanh" else F.silu

    def forward(self, x: torch.Tensor, step: bool = False) -> torch.Tensor:
        gate_up = self.gate_up_proj
        if not step and isinstance(gate_up, PackedLinear) and gate_up.gates(self.activation):
            return _product(self.down_proj, gate_up.gated(x, self.activation), step)  # bf16's prefill rows
        gate, up = _product(gate_up, x, step).split(self.inter, dim=-1)
        return _product(self.down_proj, self.act(gate) * up, step)


# Weights the model keeps stacked, and the checkpoint's weights they stack, in order (rows, then biases)
STACKED = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
           "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}


def stack_checkpoint(state: dict[str, torch.Tensor]) -> None:
    """Rename a checkpoint's per-layer weights (`layers.N.self_attn.q_proj.weight`, ...) to this model's
    stacked ones, in place."""
    for name in [n for n in state if n.endswith(("self_attn.q_proj.weight", "self_attn.q_proj.bias",
                                                  "mlp.gate_proj.weight"))]:
        layer = name[: name.index(".self_attn.") if ".self_attn." in name else name.index(".mlp.")]
        for ours, theirs in STACKED.items():
            for kind in ("weight", "bias"):
                parts = [f"{layer}.{t}.{kind}" for t in theirs]
                if all(p in state for p in parts):
                    state[f"{layer}.{ours}.{kind}"] = torch.cat([state.pop(p) for p in parts])


def _product(layer: nn.Module, x: torch.Tensor, step: bool) -> torch.Tensor:
    """A linear layer on rows x; for the rows of a decoding step (`step`), on the kernel the layer keeps
    for few rows where it keeps one (`PackedLinear.step`)."""
    return cast(torch.Tensor, layer.step(x) if step and isinstance(layer, PackedLinear) else layer(x))


def _linear_rows(layer: nn.Module, x: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows lo:hi of a linear layer's output alone (the q, or the k and v, of a stacked projection)."""
    if isinstance(layer, Int8Linear | PackedLinear | W8A8Linear | GroupLinear | LowBitLinear):  # converted, in parts
        return layer.linear_rows(x, lo, hi)
    assert isinstance(layer, nn.Linear)
    return F.linear(x, layer.weight[lo:hi], None if layer.bias is None else layer.bias[lo:hi])


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)  # noqa: E731
        self.input_layernorm = norm()
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = norm()  # Llama: the pre-MLP norm; Gemma: after attention
        self.pre_feedforward_layernorm: RMSNorm | None = norm() if cfg.sandwich_norm else None
        self.post_feedforward_layernorm: RMSNorm | None = norm() if cfg.sandwich_norm else None
        self.mlp = MLP(cfg)


def attention_mask(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None) -> torch.Tensor:
    """Exact causal mask (Tq, Tk) from positions: a query sees keys at or before it, within the window."""
    dist = q_pos[:, None] - k_pos[None, :]
    mask = dist >= 0
    if window is not None:
        mask &= dist < window
    return mask


class RowPlan:
    """What every layer derives from one set of query positions and key positions: RoPE's cos and sin
    per RoPE spec, and `attend`'s query blocks and masks per window. A layer loop whose rows stay the
    same builds them once instead of once per layer (a mask over a few thousand keys costs about as much
    as a small matmul). Pure in its inputs: a plan gives exactly what the plan-free calls compute."""

    __slots__ = ("cfg", "q_pos", "k_pos", "_rope", "_blocks")

    def __init__(self, cfg: ModelConfig, q_pos: torch.Tensor, k_pos: torch.Tensor | None = None) -> None:
        self.cfg, self.q_pos = cfg, q_pos
        self.k_pos = q_pos if k_pos is None else k_pos
        self._rope: dict[RopeSpec, tuple[torch.Tensor, torch.Tensor]] = {}
        self._blocks: dict[tuple[int | None, torch.dtype | None], list[AttnBlock]] = {}

    def rope(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and signed sin (`rope.signed_sin`), (T, head_dim), of the query positions for that layer's RoPE."""
        spec = self.cfg.rope(layer)
        if spec not in self._rope:
            cos, sin = rope_cos_sin(self.q_pos, self.cfg.head_dim, spec)
            self._rope[spec] = cos, signed_sin(sin)
        return self._rope[spec]

    def blocks(self, layer: int, dtype: torch.dtype | None = None) -> list[AttnBlock]:
        """`attend`'s blocks for that layer's window: each a run of queries, the keys its mask can reach
        and that mask: boolean, or with a dtype additive in it (`_low_attention` adds it to its scores:
        adding a zero keeps a score's bits, and one pass over them costs a seventh of a broadcast
        masked fill's)."""
        window = self.cfg.window(layer)
        if (window, dtype) not in self._blocks:
            q_pos, k_pos, out = self.q_pos, self.k_pos, []
            for s, e in _query_blocks(q_pos):
                qp = q_pos[s:e]
                lo = int(torch.searchsorted(k_pos, qp[0] - window + 1)) if window is not None else 0
                hi = int(torch.searchsorted(k_pos, qp[-1], right=True))
                mask = attention_mask(qp, k_pos[lo:hi], window)
                if dtype is not None:
                    mask = torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill_(~mask, float("-inf"))
                out.append((s, e, lo, hi, mask))
            self._blocks[window, dtype] = out
        return self._blocks[window, dtype]

    def matches(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> bool:
        return _same(self.q_pos, q_pos) and _same(self.k_pos, k_pos)


class RowPlans:
    """The few most recent `RowPlan`s of a layer loop, found again by their positions' values."""

    def __init__(self, cfg: ModelConfig, keep: int = 4) -> None:
        self.cfg, self.keep = cfg, keep
        self._plans: list[RowPlan] = []

    def get(self, q_pos: torch.Tensor, k_pos: torch.Tensor | None = None) -> RowPlan:
        k = q_pos if k_pos is None else k_pos
        for plan in self._plans:
            if plan.matches(q_pos, k):
                return plan
        plan = RowPlan(self.cfg, q_pos, k)
        self._plans = [plan, *self._plans[: self.keep - 1]]
        return plan


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a is b or (a.shape == b.shape and torch.equal(a, b))


def _normal(*shape: int) -> torch.Tensor:
    """nn.Embedding's own initial weight, drawn only where there is memory to draw into: on the meta
    device (`weights.load_model` builds the model there, then loads every weight) a normal draw goes
    through torch's reference decompositions, whose first use imports torch._dynamo (1.6 s)."""
    t = torch.empty(shape)
    return t if t.is_meta else t.normal_()


class Decoder(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Embedding | Int8Embedding = nn.Embedding(
            cfg.vocab_size, cfg.hidden_size, _weight=_normal(cfg.vocab_size, cfg.hidden_size))
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, cfg.norm_weight_offset)
        if not cfg.tie_embeddings:
            self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        # the dtype of `attend`'s two products (a prefill's attention) where not the queries' own (SDPA's),
        # and the one keys and values are rounded to as computed: bf16's on the CPU is bfloat16
        # (`precision.convert`)
        self.attention_dtype: torch.dtype | None = None

    # -- per-layer API ---------------------------------------------------------------------------

    def block(self, i: int) -> Block:
        return cast(Block, self.layers[i])

    @property
    def device(self) -> torch.device:
        """Where the weights are, and so where every tensor of a request's computation lives."""
        return self.norm.weight.device

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of hidden states and of the KV this model computes (its precision's, `precision.py`)."""
        return self.norm.weight.dtype

    @property
    def kv_dtype(self) -> torch.dtype:
        """The dtype this model's keys and values hold in exactly: `attention_dtype` where a prefill's
        attention reads them rounded to it (they are rounded once, as they are computed: `_key_value`),
        else the compute dtype. A cache stored in it loses nothing (`Engine(kv_dtype=None)`)."""
        return self.attention_dtype or self.compute_dtype

    def embed(self, ids: torch.Tensor) -> torch.Tensor:
        """Token ids (T,) -> hidden states (T, hidden)."""
        h = self.embed_tokens(ids)
        return h * torch.tensor(self.cfg.embed_scale, dtype=h.dtype) if self.cfg.embed_scale != 1.0 else h

    def project(self, i: int, h: torch.Tensor, pos: torch.Tensor, plan: RowPlan | None = None, step: bool = False
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Layer i's q (heads, T, D), k and v (kv_heads, T, D) for hidden states h at positions pos
        (`plan`, if given, is pos's: its cos and sin are reused; `step`: the rows of a decoding step,
        whose products may run on another kernel, `PackedLinear.step`)."""
        attn = self.block(i).self_attn
        x = self.block(i).input_layernorm(h)
        if not step and isinstance(attn.qkv_proj, PackedLinear):  # a prefill's rows: q's part, then k and v's
            q, kv = attn.qkv_proj.each(x)
            k, v = kv.split(attn.kv_size, -1)
        else:
            q, k, v = _product(attn.qkv_proj, x, step).split((attn.q_size, attn.kv_size, attn.kv_size), -1)
        cos, sin = self._cos_sin(i, pos, plan)
        return (self._query(i, q, cos, sin), *self._key_value(i, k, v, cos, sin))

    def query(self, i: int, h: torch.Tensor, pos: torch.Tensor, plan: RowPlan | None = None) -> torch.Tensor:
        """Layer i's q alone (blend computes keys for more tokens than it runs queries for)."""
        attn = self.block(i).self_attn
        q = _linear_rows(attn.qkv_proj, self.block(i).input_layernorm(h), 0, attn.q_size)
        return self._query(i, q, *self._cos_sin(i, pos, plan))

    def key_value(self, i: int, h: torch.Tensor, pos: torch.Tensor, plan: RowPlan | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer i's k and v alone."""
        attn = self.block(i).self_attn
        kv = _linear_rows(attn.qkv_proj, self.block(i).input_layernorm(h), attn.q_size, attn.q_size + 2 * attn.kv_size)
        k, v = kv.split(attn.kv_size, -1)
        return self._key_value(i, k, v, *self._cos_sin(i, pos, plan))

    def _cos_sin(self, i: int, pos: torch.Tensor, plan: RowPlan | None) -> tuple[torch.Tensor, torch.Tensor]:
        if plan is not None:
            assert plan.q_pos.shape == pos.shape, "a plan is for the positions it was made of"
            return plan.rope(i)
        cos, sin = rope_cos_sin(pos, self.cfg.head_dim, self.cfg.rope(i))
        return cos, signed_sin(sin)

    def _query(self, i: int, q: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """Projected queries (T, heads*D) -> normed and rotated (heads, T, D), a view of (T, heads, D) in
        memory: the rows as the product wrote them, which the norm reads twice as fast as heads first, and
        which `_low_attention` reads one query's heads after another (the values are the same either way:
        each is a function of its own head vector)."""
        cfg, attn = self.cfg, self.block(i).self_attn
        q = q.reshape(q.shape[0], cfg.num_heads, cfg.head_dim)
        return rotate(attn.q_norm(q) if attn.q_norm is not None else q, cos[:, None], sin[:, None]).transpose(0, 1)

    def _key_value(self, i: int, k: torch.Tensor, v: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                   ) -> tuple[torch.Tensor, torch.Tensor]:
        """Projected keys and values (T, kv_heads*D) -> (kv_heads, T, D), the keys normed and rotated;
        with an `attention_dtype`, both rounded to it (and held in the compute dtype): a prefill's
        attention reads them so anyway, and rounding them here, once, gives decoding steps and every
        kept cache the same numbers, which `kv_dtype` then stores in half the bytes exactly."""
        cfg, attn = self.cfg, self.block(i).self_attn
        k = k.reshape(k.shape[0], cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        v = v.reshape(v.shape[0], cfg.num_kv_heads, cfg.head_dim).transpose(0, 1)
        k = rotate(attn.k_norm(k) if attn.k_norm is not None else k, cos, sin)
        low = self.attention_dtype
        return (k, v) if low is None else (k.to(low).to(k.dtype), v.to(low).to(v.dtype))

    def attend(
        self, i: int, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, v: torch.Tensor, k_pos: torch.Tensor,
        plan: RowPlan | None = None,
    ) -> torch.Tensor:
        """Attention of queries at q_pos over keys at k_pos under the exact causal (and window) mask -> (Tq, heads*D),
        in q's dtype, or in the attention dtype where the products run in it (`_low_attention`).

        Both position vectors must be ascending. Long query sets run in blocks of ATTN_BLOCK queries,
        each against only the keys its mask can reach, so a sliding layer costs O(T * window). `plan`
        (of q_pos and k_pos) reuses the blocks and masks an earlier layer built.
        """
        cfg = self.cfg
        window = cfg.window(i)
        low = self.attention_dtype is not None
        if cfg.attn_softcap is not None:
            out = _softcapped_attention(q, k, v, attention_mask(q_pos, k_pos, window), cfg)
        elif not low and q.shape[1] == k.shape[1] and window is None and torch.equal(q_pos, k_pos):
            # plain causal prefill: SDPA's causal kernel skips the masked half itself
            out = F.scaled_dot_product_attention(
                q[None], k[None], v[None], is_causal=True, scale=cfg.query_scale, enable_gqa=True
            )[0]
        else:
            if plan is not None:
                assert plan.q_pos.shape == q_pos.shape and plan.k_pos.shape == k_pos.shape, "a plan of other positions"
            blocks = (plan or RowPlan(cfg, q_pos, k_pos)).blocks(i, self.attention_dtype)
            if low:
                return _low_attention(q, k, v, blocks, cfg.query_scale, cast(torch.dtype, self.attention_dtype))
            parts = [
                F.scaled_dot_product_attention(
                    q[None, :, s:e], k[None, :, lo:hi], v[None, :, lo:hi], attn_mask=mask[None, None],
                    scale=cfg.query_scale, enable_gqa=True,
                )[0]
                for s, e, lo, hi, mask in blocks
            ]
            out = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
        return out.transpose(0, 1).reshape(q.shape[1], cfg.num_heads * cfg.head_dim)

    def attend_all(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of queries that may see every given key (decoding one token over exactly the keys
        in its reach) -> (Tq, heads*D); the same result as `attend` without building a mask."""
        cfg = self.cfg
        if cfg.attn_softcap is not None:
            visible = torch.ones(q.shape[1], k.shape[1], dtype=torch.bool)
            out = _softcapped_attention(q, k, v, visible, cfg)
        else:  # plain matmuls: for a handful of queries SDPA's kernel costs twice as much on CPU
            kv_heads, tq = k.shape[0], q.shape[1]
            qg = q.reshape(kv_heads, -1, cfg.head_dim)  # the query heads that share a kv head, stacked
            # keys times queries, not queries times keys: the BLAS reads a long key matrix in this
            # orientation at memory speed, and four times slower in the other (docs/benchmarks.md, stop 50).
            # Few operator calls: a draft step makes this call for every row on every layer.
            scores = torch.bmm(k, qg.transpose(1, 2)).transpose(1, 2).contiguous()  # this call's own tensor
            scores = scores.mul_(cfg.query_scale) if scores.dtype == torch.float32 else scores.float() * cfg.query_scale
            probs = torch.softmax(scores, dim=-1)
            probs = probs if probs.dtype == v.dtype else probs.to(v.dtype)
            out = _weighted_values(probs, v)
            if tq == 1:  # (kv_heads, heads/kv_heads, D) is already (1, heads*D) in memory
                return out.reshape(1, cfg.num_heads * cfg.head_dim)
            out = out.reshape(cfg.num_heads, tq, cfg.head_dim)
        return out.transpose(0, 1).reshape(q.shape[1], cfg.num_heads * cfg.head_dim)

    def attend_rows(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ends: Sequence[int]
                    ) -> torch.Tensor:
        """Attention of consecutive rows of one sequence on a full-attention layer (a decoding step's
        draft), row r over keys [0, ends[r]) -> (rows, heads*D): each row bitwise what `attend_all`'s
        arithmetic gives it alone, since every row's scores and softmax are its own call's. Its weighted
        values are split at the last multiple of VALUE_BLOCK below its end: that body is one product for
        all the rows with the same body (the values read once for a draft, not once a row: at 10k keys
        the most of a draft row's cost), and the rest a product of the row's own. A row alone is
        computed the same way, so its result does not depend on the rows beside it, where this BLAS's
        product gives every row of a body the same result however many share it (`shares_values`,
        checked once); elsewhere (and with a softcap) every row is `attend_all`'s call of its own."""
        cfg = self.cfg
        kv_heads, group = k.shape[0], cfg.num_heads // k.shape[0]
        if cfg.attn_softcap is not None or not shares_values(kv_heads, group, cfg.head_dim, v.dtype, v.device,
                                                             torch.get_num_threads()):
            return torch.cat([self.attend_all(i, q[:, r : r + 1], k[:, :e], v[:, :e]) for r, e in enumerate(ends)])
        probs = []
        for r, e in enumerate(ends):
            qg = q[:, r : r + 1].reshape(kv_heads, -1, cfg.head_dim)  # as `attend_all`'s one row
            scores = torch.bmm(k[:, :e], qg.transpose(1, 2)).transpose(1, 2).contiguous()
            scores = scores.mul_(cfg.query_scale) if scores.dtype == torch.float32 else scores.float() * cfg.query_scale
            p = torch.softmax(scores, dim=-1)
            probs.append(p if p.dtype == v.dtype else p.to(v.dtype))
        bodies: dict[int, list[int]] = {}
        for r, e in enumerate(ends):
            bodies.setdefault(e - e % VALUE_BLOCK, []).append(r)
        outs: list[torch.Tensor] = [probs[0]] * len(ends)
        for f, rows in bodies.items():
            for at in range(0, len(rows), MAX_SHARED_ROWS):
                some = rows[at : at + MAX_SHARED_ROWS]
                body = _weighted_values(torch.cat([probs[r][:, :, :f] for r in some], 1), v[:, :f]) if f else None
                for j, r in enumerate(some):
                    out = body[:, j * group : (j + 1) * group] if body is not None else None
                    if ends[r] > f:
                        tail = torch.bmm(probs[r][:, :, f:], v[:, f : ends[r]])
                        out = tail if out is None else out + tail
                    assert out is not None
                    outs[r] = out.reshape(1, cfg.num_heads * cfg.head_dim)
        return torch.cat(outs)

    def attend_windows(self, i: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ends: Sequence[int]
                       ) -> torch.Tensor:
        """Attention of consecutive rows of one sequence on a sliding layer whose windows are all full,
        row r over the window's keys before ends[r] -> (rows, heads*D), as one batch of products of
        the same shapes (the windows are views of the cache, no copy); a row's result is the same in
        any batch where this BLAS's batched products give each element what it gives alone
        (`batches_windows`, checked once), else every row is a call of its own."""
        cfg, w = self.cfg, self.cfg.window(i)
        assert w is not None and ends[0] >= w, "full windows of a sliding layer"
        if cfg.attn_softcap is not None or k.shape[0] != 1 or not batches_windows(
                w, q.shape[0], cfg.head_dim, v.dtype, v.device, torch.get_num_threads()):
            return torch.cat([self.attend_all(i, q[:, r : r + 1], k[:, e - w : e], v[:, e - w : e])
                              for r, e in enumerate(ends)])
        return torch.cat([_window_rows(q[:, at : at + MAX_SHARED_ROWS], k, v, ends[at] - w, w, cfg.query_scale)
                          .reshape(len(ends[at : at + MAX_SHARED_ROWS]), -1)
                          for at in range(0, len(ends), MAX_SHARED_ROWS)])

    def attention_to(
        self, i: int, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor, lo: int, hi: int,
        over_range: bool = False,
    ) -> torch.Tensor:
        """The attention probabilities (heads, Tq, hi - lo) that `attend` applies to keys lo:hi, normalised
        over every key: `attention_weights(...)[:, :, lo:hi]` (its oracle); with `over_range`, normalised
        over keys lo:hi alone (each query's attention shared out among them). For a few queries over many
        keys (query-aware selection): each key head's scores are one matmul for its group of query heads,
        the softmax's normaliser comes from the scores of lo:hi and of the few other keys, and a mask is
        applied only where it hides something."""
        cfg = self.cfg
        qg = q.float().reshape(k.shape[0], -1, q.shape[-1])  # the query heads that share a key head, stacked

        def scores(keys: slice) -> torch.Tensor:
            s = (qg @ k[:, keys].float().transpose(1, 2)).view(q.shape[0], q.shape[1], -1) * cfg.query_scale
            if cfg.attn_softcap is not None:
                s = torch.tanh(s / cfg.attn_softcap) * cfg.attn_softcap
            mask = attention_mask(q_pos, k_pos[keys], cfg.window(i))
            return s if bool(mask.all()) else s.masked_fill(~mask, float("-inf"))

        inside = scores(slice(lo, hi))
        if over_range:  # a query that sees none of lo:hi gives it nothing (softmax would give NaN)
            return torch.softmax(inside, -1).nan_to_num_(0.0)
        norm = inside.logsumexp(-1)
        for rest in (slice(0, lo), slice(hi, k.shape[1])):
            if rest.stop > rest.start:
                norm = torch.logaddexp(norm, scores(rest).logsumexp(-1))
        return torch.exp(inside - norm[..., None])

    def attention_weights(
        self, i: int, q: torch.Tensor, q_pos: torch.Tensor, k: torch.Tensor, k_pos: torch.Tensor
    ) -> torch.Tensor:
        """The attention probabilities (heads, Tq, Tk) that `attend` applies; for analysis, not speed."""
        cfg = self.cfg
        k = k.repeat_interleave(cfg.num_heads // cfg.num_kv_heads, 0)
        scores = (q.float() @ k.float().transpose(1, 2)) * cfg.query_scale
        if cfg.attn_softcap is not None:
            scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
        scores = scores.masked_fill(~attention_mask(q_pos, k_pos, cfg.window(i)), float("-inf"))
        return torch.softmax(scores, dim=-1)

    def finish(self, i: int, h: torch.Tensor, attn_out: torch.Tensor, step: bool = False) -> torch.Tensor:
        """Output projection, residual and MLP of layer i for the tokens whose attention output is given
        (`step`: as in `project`)."""
        blk = self.block(i)
        o = _product(blk.self_attn.o_proj, attn_out, step)
        if blk.pre_feedforward_layernorm is not None and blk.post_feedforward_layernorm is not None:
            h = h + blk.post_attention_layernorm(o)
            return h + blk.post_feedforward_layernorm(blk.mlp(blk.pre_feedforward_layernorm(h), step))
        h = h + o
        return h + blk.mlp(blk.post_attention_layernorm(h), step)

    def layer(
        self,
        i: int,
        h: torch.Tensor,
        pos: torch.Tensor,
        past_k: torch.Tensor | None = None,
        past_v: torch.Tensor | None = None,
        past_pos: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """One full layer for new tokens h at pos after cached keys; returns (h_out, k_new, v_new)."""
        q, k, v = self.project(i, h, pos)
        if past_k is not None and past_k.shape[1]:
            assert past_v is not None and past_pos is not None
            keys, values, k_pos = torch.cat((past_k, k), 1), torch.cat((past_v, v), 1), torch.cat((past_pos, pos))
        else:
            keys, values, k_pos = k, v, pos
        return self.finish(i, h, self.attend(i, q, pos, keys, values, k_pos)), k, v

    def head_weight(self) -> torch.Tensor | GroupTable | LowBitTable:
        """The LM head's (vocab, hidden) float weight: the embeddings when they are tied (a table in
        groups: its rows, dequantised as they are read)."""
        head = self.embed_tokens if self.cfg.tie_embeddings else self.lm_head
        if isinstance(head, GroupEmbedding | GroupLinear | LowBitRows):
            return head.table()
        if not isinstance(head, nn.Embedding | nn.Linear):
            raise TypeError("an int8 model's LM head has no float weight")
        return head.weight

    def head(self, x: torch.Tensor) -> torch.Tensor:
        """The LM head alone on normed hidden states: (T, hidden) -> (T, vocab) in the compute dtype."""
        if not self.cfg.tie_embeddings:
            return cast(torch.Tensor, self.lm_head(x))
        if isinstance(self.embed_tokens, Int8Embedding | GroupEmbedding | LowBitEmbedding):  # its own head
            return self.embed_tokens.linear(x)
        return F.linear(x, self.embed_tokens.weight)

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        """Final norm and LM head: (T, hidden) -> (T, vocab) in float32."""
        out = self.head(self.norm(h)).float()
        if self.cfg.final_softcap is not None:
            out = torch.tanh(out / self.cfg.final_softcap) * self.cfg.final_softcap
        return out

    # -- the naive path ----------------------------------------------------------------------------

    def forward(self, ids: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (T, vocab) of a full forward pass, optionally under a custom (T, T) boolean mask."""
        pos = torch.arange(ids.shape[0], device=ids.device)
        h = self.embed(ids)
        for i in range(self.cfg.num_layers):
            q, k, v = self.project(i, h, pos)
            if mask is None:
                a = self.attend(i, q, pos, k, v, pos)
            else:
                m = mask & attention_mask(pos, pos, self.cfg.window(i))
                a = F.scaled_dot_product_attention(
                    q[None], k[None], v[None], attn_mask=m[None, None], scale=self.cfg.query_scale, enable_gqa=True
                )[0]
                a = a.transpose(0, 1).reshape(ids.shape[0], -1)
            h = self.finish(i, h, a)
        return self.logits(h)


def _query_blocks(q_pos: torch.Tensor) -> list[tuple[int, int]]:
    """Split ascending query positions into blocks of at most ATTN_BLOCK queries, each spanning at most
    ATTN_BLOCK positions. A block computes the scores of all its queries against every key from its
    first query's reach (the window, on a sliding layer) to its last query, masking the rest; sparse
    queries (a fuser's picks, a fifth of the positions) in blocks of ATTN_BLOCK queries would span five
    times as many positions and compute mostly masked scores, on sliding and full-attention layers
    alike. Bounding the span takes a quarter off a fused request's full-attention layers; the masked
    scores add nothing, so its results move only by rounding (a product over fewer keys sums in another
    order: the logits of a fused request by 2e-5 in fp32, within one bfloat16 rounding in bf16, the
    same tokens). A contiguous prefill's blocks, and so every cache kept, do not change."""
    n = q_pos.shape[0]
    if n == 0 or int(q_pos[-1] - q_pos[0]) < ATTN_BLOCK:
        return [(s, min(n, s + ATTN_BLOCK)) for s in range(0, n, ATTN_BLOCK)]
    ends = torch.searchsorted(q_pos, q_pos + ATTN_BLOCK).tolist()  # first query out of each one's span
    blocks, s = [], 0
    while s < n:
        e = min(n, s + ATTN_BLOCK, ends[s])
        blocks.append((s, e))
        s = e
    return blocks


SPLIT_KEYS = 1024  # `_weighted_values` splits the keys in two from this many on (a sliding layer of 512 never)
VALUE_BLOCK = 64  # `Decoder.attend_rows`: a row's weighted values over keys up to a multiple of this are shared
MAX_SHARED_ROWS = 16  # the most rows in one shared product (`shares_values` checks up to this many)


def _window_rows(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, first: int, w: int, scale: float
                 ) -> torch.Tensor:
    """Queries q (heads, m, D) of consecutive rows, row r over keys first + r to first + r + w of one kv
    head's k and v (1, T, D): each row's window a view, one batched product each for scores and values
    -> (m, heads, D)."""
    m, d = q.shape[1], q.shape[2]
    qt = q.transpose(0, 1).contiguous()  # (m, heads, D): one layout whatever q's strides (the check's and a step's)
    kw = k.as_strided((m, w, d), (k.stride(1), k.stride(1), k.stride(2)), k.storage_offset() + first * k.stride(1))
    vw = v.as_strided((m, w, d), (v.stride(1), v.stride(1), v.stride(2)), v.storage_offset() + first * v.stride(1))
    scores = torch.bmm(kw, qt.transpose(1, 2)).transpose(1, 2).contiguous()  # (m, heads, w)
    scores = scores.mul_(scale) if scores.dtype == torch.float32 else scores.float() * scale
    probs = torch.softmax(scores, dim=-1)
    return torch.bmm(probs if probs.dtype == v.dtype else probs.to(v.dtype), vw)


@functools.cache
def batches_windows(w: int, heads: int, head_dim: int, dtype: torch.dtype, device: torch.device, threads: int
                    ) -> bool:
    """Whether `_window_rows` gives each row the same result alone as beside up to MAX_SHARED_ROWS - 1
    others (one kv head; a window of w keys), on this machine's BLAS at this many threads, once. Only
    on the CPU."""
    if device.type != "cpu":
        return False
    gen = torch.Generator().manual_seed(1)
    n = w + MAX_SHARED_ROWS
    k, v = (torch.randn(1, n, head_dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(heads, MAX_SHARED_ROWS, head_dim, generator=gen).to(dtype)
    alone = [_window_rows(q[:, r : r + 1], k, v, r, w, 0.1) for r in range(MAX_SHARED_ROWS)]
    for first in range(MAX_SHARED_ROWS - 1):
        together = _window_rows(q[:, first:], k, v, first, w, 0.1)
        if not all(torch.equal(together[j], alone[first + j][0]) for j in range(together.shape[0])):
            return False
    return True


@functools.cache
def shares_values(kv_heads: int, group: int, head_dim: int, dtype: torch.dtype, device: torch.device, threads: int
                  ) -> bool:
    """Whether `_weighted_values` gives each row of its probabilities the same result alone as beside up
    to MAX_SHARED_ROWS - 1 other rows' (of `group` query heads each), at the key counts a decoding body
    has (below and above SPLIT_KEYS, up to 16k keys, odd and even halves): a BLAS picks its kernel and
    its split among threads by shape, so this is checked on this machine's BLAS at this many threads,
    once. Only on the CPU (elsewhere rows keep their own calls)."""
    if device.type != "cpu":
        return False
    gen = torch.Generator().manual_seed(0)
    for n in (VALUE_BLOCK, 5 * VALUE_BLOCK, SPLIT_KEYS + VALUE_BLOCK, SPLIT_KEYS + 3 * VALUE_BLOCK,
              4 * SPLIT_KEYS + VALUE_BLOCK, 16 * SPLIT_KEYS + 3 * VALUE_BLOCK):
        v = torch.randn(kv_heads, n, head_dim, generator=gen).to(dtype)
        probs = torch.softmax(torch.randn(kv_heads, MAX_SHARED_ROWS * group, n, generator=gen), -1).to(dtype)
        alone = [_weighted_values(probs[:, r * group : (r + 1) * group].contiguous(), v)
                 for r in range(MAX_SHARED_ROWS)]
        for rows in range(2, MAX_SHARED_ROWS + 1):
            together = _weighted_values(probs[:, : rows * group].contiguous(), v)
            if not all(torch.equal(together[:, r * group : (r + 1) * group], alone[r]) for r in range(rows)):
                return False
    return True


def _weighted_values(probs: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """probs (kv_heads, Tq, T) @ v (kv_heads, T, D). With one kv head and many keys, as two products over
    the halves of the keys, batched, then summed: the BLAS runs one product of a few rows on one thread,
    and the batch of two on two (twice as fast at 10k keys). The order of the sums depends only on the
    shapes, so a row's result is the same alone or beside others."""
    kv_heads, tq, n = probs.shape
    half = n // 2
    if kv_heads != 1 or n < SPLIT_KEYS:
        return torch.bmm(probs, v)
    halves = probs[0, :, : 2 * half].unflatten(-1, (2, half)).transpose(0, 1)  # (2, Tq, half)
    out = torch.bmm(halves, v[0, : 2 * half].unflatten(0, (2, half))).sum(0, keepdim=True)
    return out + torch.bmm(probs[:, :, 2 * half :], v[:, 2 * half :]) if n % 2 else out


def _low_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, blocks: Sequence[AttnBlock], scale: float,
                   dtype: torch.dtype) -> torch.Tensor:
    """Masked attention of queries q (heads, Tq, D) over k, v (kv_heads, Tk, D) in `attend`'s blocks, whose
    two products run in dtype (bfloat16: oneDNN's avx512_bf16 or AMX kernels, 1.5-2x SDPA's float32 one
    here, docs/benchmarks.md) -> (Tq, heads*D) in dtype: the output projection, which runs in it, reads
    it as it is (a float32 copy would round back to the same numbers).

    q is scaled, then rounded to dtype once for all blocks, and so are the keys and values the blocks
    read, once for each run of blocks whose keys overlap (a sliding layer's neighbours read a window in
    common; a prompt's first and last rows around a fused middle read two runs far apart). Each block's
    scores come back rounded to dtype (no float32 output on the CPU), take its mask additively
    (`RowPlan.blocks`), and softmax reads them, sums in float32 and rounds the probabilities to dtype
    (no float32 copy of the scores: the copies cost more than the products).

    With one kv head (Gemma 3's) a block's rows are its queries' heads one query after another, so the
    block is two plain matrix products: the keys read transposed where they lie (a batched product
    copies them first, a third of a small block's time) and the output written straight into its rows
    of the result, with no transpose; each row's arithmetic is the same in any order of the rows."""
    (heads, tq, d), kv_heads = q.shape, k.shape[0]
    runs = [(lo, hi, k[:, lo:hi].to(dtype), v[:, lo:hi].to(dtype)) for lo, hi in _key_runs(blocks)]

    def keys(lo: int, hi: int) -> tuple[torch.Tensor, torch.Tensor]:
        at, _, kl, vl = next(r for r in runs if r[0] <= lo and hi <= r[1])
        return kl[:, lo - at : hi - at], vl[:, lo - at : hi - at]

    if kv_heads == 1:
        qs = (q.transpose(0, 1) * scale).to(dtype)  # (Tq, heads, D): contiguous from `Decoder._query`
        out = torch.empty(tq, heads * d, dtype=dtype, device=q.device)
        for s, e, lo, hi, mask in blocks:
            kb, vb = keys(lo, hi)
            scores = torch.mm(qs[s:e].reshape(-1, d), kb[0].T)
            probs = torch.softmax(scores.view(e - s, heads, -1).add_(mask[:, None]), -1)
            torch.mm(probs.view((e - s) * heads, -1), vb[0], out=out[s:e].view(-1, d))
        return out
    group, qs_all = heads // kv_heads, (q * scale).to(dtype)
    parts = []
    for s, e, lo, hi, mask in blocks:
        kb, vb = keys(lo, hi)
        qs = qs_all[:, s:e].reshape(kv_heads, group * (e - s), d)
        scores = torch.bmm(qs, kb.transpose(1, 2)).view(kv_heads, group, e - s, -1)
        probs = torch.softmax(scores.add_(mask), -1)
        parts.append(torch.bmm(probs.view(kv_heads, group * (e - s), -1), vb).view(heads, e - s, d))
    out = torch.cat(parts, 1) if len(parts) > 1 else parts[0]
    return out.transpose(0, 1).reshape(tq, heads * d)


def _key_runs(blocks: Sequence[AttnBlock]) -> list[tuple[int, int]]:
    """The key ranges `attend`'s blocks read, those that overlap or touch merged, in order."""
    runs: list[tuple[int, int]] = []
    for _, _, lo, hi, _ in sorted(blocks, key=lambda b: b[2]):
        if runs and lo <= runs[-1][1]:
            runs[-1] = (runs[-1][0], max(runs[-1][1], hi))
        else:
            runs.append((lo, hi))
    return runs


def _softcapped_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, cfg: ModelConfig
) -> torch.Tensor:
    groups = cfg.num_heads // cfg.num_kv_heads
    k, v = k.repeat_interleave(groups, 0), v.repeat_interleave(groups, 0)
    assert cfg.attn_softcap is not None
    scores = (q @ k.transpose(1, 2)) * cfg.query_scale
    scores = torch.tanh(scores / cfg.attn_softcap) * cfg.attn_softcap
    scores = scores.masked_fill(~mask, float("-inf"))
    return torch.softmax(scores.float(), dim=-1).to(q.dtype) @ v

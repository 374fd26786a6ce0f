"""Precisions: the dtype a model's weights and activations are computed in (`--precision`).

- `fp32`: float32 throughout; the oracle the others are measured against. Its layer weights are
  prepacked for oneDNN (`packed.py`), which reads them about twice as fast in a decoding step.
- `bf16`: every layer's linear weights in bfloat16, prepacked for oneDNN (`packed.py`), for CPUs with
  AMX, where a prefill's products run about ten times faster than float32's (on a CPU without bfloat16
  hardware they are several times slower). A product takes its input rounded to bfloat16 and returns
  float32; norms, softmax, the residual stream, the embedding table and the LM head stay float32,
  which is what keeps answers close to fp32's (an all-bfloat16 model, with a bfloat16 residual stream
  and bfloat16 logits that tie at the top, agreed with fp32's first token on 0.90 of MuSiQue cases;
  docs/benchmarks.md). A prefill's attention products run in bfloat16, and keys and values are rounded
  to bfloat16 as they are computed, so its caches are stored in bfloat16 exactly (`Decoder.kv_dtype`).
  Greedy steps screen the float32 head in int8 like fp32's.
- `int8`: weight-only int8 with a per-output-row scale for every linear layer and the LM head
  (`quant.py`); activations, norms and the residual stream stay float32 (bfloat16 element-wise ops
  are slower than float32's on a CPU without AVX-512 BF16, and they cost fidelity); a tied table's
  embedding lookups are dequantised from the same int8 matrix as the head.
- `w8a8`: int8's weights, and every linear's and the head's input rows rounded to 8-bit integers on
  their own scale (7-bit without VNNI), multiplied in FBGEMM's int8 kernel (`w8a8.py`): faster than
  int8 at every row count, prefill included. Norms, attention, the residual stream and the KV stay
  float32.

- `lowbit`: the checkpoint's own quantisation groups as `groups` reads them, held packed at 4 bits a
  weight (Q4_0, Q4_1, Q4_K) or 8 (Q5_0, Q5_1, Q5_K, Q6_K, Q8_0, and weights without blocks, quantised
  to 8-bit groups of 32), with their float32 scales and offsets (`lowbit.py`). Decoding steps' products
  (at most `lowbit.KERNEL_ROWS` rows) run on kvfuse's own kernel, input rows rounded to int8 per block of
  32 (llama.cpp's Q8_0 activations); a prefill's dequantise the weight into a reused buffer and run in
  bfloat16 on CPUs with bfloat16 hardware (as bf16's prefill, its attention, keys and values in
  bfloat16 too: its caches are stored in half the bytes), else float32. The LM head too: no float
  copy of any weight is kept.
- `groups`: the checkpoint's own quantisation groups (`groups.py`): a GGUF's blocks (Q8_0, Q4_0/1,
  Q5_0/1, Q4_K, Q5_K, Q6_K) held exactly as int8 values with a float32 scale (and offset) per group of
  16 or 32 inputs, other weights quantised to 8-bit groups of 32. Products dequantise a slice of rows
  and run in float32, so on a GGUF's checkpoint it computes fp32's function in 1.25-1.5 bytes a weight
  (no kernel reads such groups at memory speed here: it is slower than fp32, docs/benchmarks.md).

A precision is part of the model fingerprint (`fingerprint`), so caches, profiles and calibrations of
different precisions never mix; fp32 keeps the plain checkpoint fingerprint.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING

from kvfuse.defaults import cpu_flags

if TYPE_CHECKING:  # torch is imported where a model is converted: the CLI reads the names without it
    from collections.abc import Callable, Mapping

    import torch
    from torch import nn

    from kvfuse.config import ModelConfig
    from kvfuse.groups import Groups
    from kvfuse.model import Decoder
    from kvfuse.quant import Rows

PRECISIONS = ("fp32", "bf16", "int8", "w8a8", "groups", "lowbit")
# the oracle every other precision is measured against, and the library's default (`Engine.load`,
# `load_model`); the CLI's default follows the CPU (`default_precision`)
DEFAULT_PRECISION = "fp32"

# Issue M's rule: the CLI's default is the fastest precision whose fidelity to fp32 on the 50 MuSiQue dev
# cases is at least llama.cpp Q4_K_M's (`benchmarks/fidelity.py`, `benchmarks/answer_time.py`;
# docs/benchmarks.md, issue M). Each entry is a CPU class where that was measured, first match wins:
# - AMX (Intel Xeon): fp32 answered a cached-kb question faster than bf16 (1.36x against 1.67x
#   llama.cpp's time, issue M's table), so fp32 until bf16 is measured faster there;
# - avx512_bf16 without AMX (AMD EPYC, stop 41): bf16 as fast as fp32 on the cached kb (1.04x against
#   1.02x), faster on RAG (0.147x against 0.18x), 0.93x the RSS, and 49/50 with KL 0.0001 against
#   llama.cpp's 42/50 with KL 0.019;
# - anything else (AVX2 only): fp32; bfloat16 products are emulated there and several times slower.
CPU_DEFAULTS = (("amx_bf16", "fp32"), ("avx512_bf16", "bf16"))


@functools.cache
def default_precision() -> str:
    """The CLI's default precision on this CPU (`CPU_DEFAULTS`); torch is not imported."""
    flags = cpu_flags()
    return next((precision for flag, precision in CPU_DEFAULTS if flag in flags), DEFAULT_PRECISION)


# every precision rounds from a float32 checkpoint
LOAD_DTYPE = {"fp32": "float32", "bf16": "float32", "int8": "float32", "w8a8": "float32", "groups": "float32",
              "lowbit": "float32"}


def check(precision: str) -> str:
    if precision not in PRECISIONS:
        raise ValueError(f"unknown precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    from kvfuse.quant import available

    if precision == "int8" and not available():
        raise ValueError("precision int8 needs torch._weight_int8pack_mm, which this PyTorch lacks")
    if precision == "w8a8":
        from kvfuse import w8a8

        if not w8a8.available():
            raise ValueError("precision w8a8 needs PyTorch's FBGEMM int8 engine (x86 builds), which this one lacks")
    if precision == "lowbit":
        from kvfuse import lowbit

        try:
            lowbit.library()
        except lowbit.KernelUnavailable as e:
            raise ValueError(f"precision lowbit: {e}") from None
    return precision


# what a precision appends to the fingerprint; a new tag whenever what it computes changes (int8's
# activations were bfloat16 before "int8-f32"; bf16's were before "bf16-f32", its prefill attention
# float32 before "-a16", its prefill MLP's activation in float32 after the product before "-g16", its keys
# and values float32 before "-k16")
TAGS = {"fp32": "", "bf16": "-bf16-f32-a16-g16-k16", "int8": "-int8-f32", "w8a8": "-w8a8", "groups": "-groups",
        "lowbit": "-lowbit" + ("-p16" if {"avx512_bf16", "amx_bf16"} & cpu_flags() else "")}  # `lowbit.bf16_prefill`


def fingerprint(checkpoint: str, precision: str) -> str:
    """The model fingerprint of a checkpoint run at a precision."""
    return checkpoint + TAGS[check(precision)]


def load_dtype(precision: str) -> torch.dtype:
    """The dtype a checkpoint is read in for this precision."""
    import torch

    return getattr(torch, LOAD_DTYPE[check(precision)])  # type: ignore[no-any-return]


def parts(cfg: ModelConfig) -> list[str]:
    """The model's parts, in the order the loader reads and converts them one at a time (`convert`):
    the embedding table first (the largest), every layer, the final norm, an untied head."""
    head = [] if cfg.tie_embeddings else ["lm_head"]
    return ["embed_tokens", *(f"layers.{i}" for i in range(cfg.num_layers)), "norm", *head]


def reads_blocks(precision: str, part: str) -> bool:
    """Whether this part is built from the checkpoint's own quantised blocks where it has them
    (`checkpoints.checkpoint_blocks`): every part in groups, and bf16's embedding table, which bf16 keeps
    in float32 and a GGUF holds in Q8_0 groups that dequantise to it bit for bit (a quarter of the
    memory, the same lookups and head; `convert`)."""
    return precision in ("groups", "lowbit") or (precision == "bf16" and part == "embed_tokens")


def by_rows(cfg: ModelConfig, part: str, precision: str) -> bool:
    """Whether this part is converted from its weight's rows, read a block at a time (`convert_rows`),
    rather than loaded whole: int8's tied table. Gemma 3's is 671 MB in float32 against 168 MB in int8,
    and reading it whole would add the float table to an int8 load's peak memory."""
    return precision in ("int8", "w8a8", "groups", "lowbit") and part == "embed_tokens" and cfg.tie_embeddings


def convert_rows(model: Decoder, part: str, rows: Rows, precision: str = "int8",
                 blocks: Mapping[str, list[Groups]] | None = None) -> None:
    """Put the converted part of `by_rows` in the model, from its weight's rows (`groups`, `lowbit`: from
    the checkpoint's own blocks where `blocks` has them)."""
    from kvfuse.groups import quantize
    from kvfuse.quant import Int8Embedding
    from kvfuse.w8a8 import W8A8Embedding

    if precision in ("groups", "lowbit"):
        own = (blocks or {}).get(f"{part}.weight")
        setattr(model, part, _table(own[0] if own else quantize(rows), precision))
        return
    setattr(model, part, W8A8Embedding(rows) if precision == "w8a8" else Int8Embedding(rows))


def _table(g: Groups, precision: str) -> nn.Module:
    """An embedding table in groups (`groups`) or packed low-bit groups (`lowbit`)."""
    from kvfuse.groups import GroupEmbedding
    from kvfuse.lowbit import LowBitEmbedding, from_groups

    return LowBitEmbedding(from_groups(g)) if precision == "lowbit" else GroupEmbedding(g)


def _to_groups(module: nn.Module, part: str, blocks: Mapping[str, list[Groups]], precision: str) -> nn.Module:
    """A part's linears as `GroupLinear`s (`lowbit`: `LowBitLinear`s): the checkpoint's own blocks where
    `blocks` has them (`<part>.<path>.weight`: q, k and v's of a stacked projection, one after another),
    else quantised to 8-bit groups."""
    from torch import nn

    from kvfuse.groups import GroupLinear, quantize, stack
    from kvfuse.lowbit import LowBitLinear, from_groups

    def grouped(path: str, lin: nn.Linear) -> nn.Module:
        own = blocks.get(f"{path}.weight") or [quantize(lin.weight)]
        if precision == "lowbit":
            return LowBitLinear([from_groups(g) for g in own], lin.bias)
        return GroupLinear(stack(own) if len(own) > 1 else own[0], lin.bias)

    if isinstance(module, nn.Linear):
        return grouped(part, module)
    for path, parent in list(module.named_modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, grouped(".".join(p for p in (part, path, name) if p), child))
    return module


def convert(model: Decoder, part: str, precision: str, blocks: Mapping[str, list[Groups]] | None = None) -> None:
    """Convert one part of a float model (`parts`) to the precision, in place.

    - fp32: the part in float32; a layer's linears prepacked (`_pack`).
    - bf16: as fp32, with a layer's linears prepacked in bfloat16.
    - int8: its linears (an untied head too) in int8 rows; what is left (norms, an untied table,
      biases) in float32. A tied table is not converted here: `by_rows` sends it to `convert_rows`.
    - w8a8: as int8, with linears that quantise their input rows too (`w8a8.W8A8Linear`).
    - groups: its linears (an untied head too) as groups (`groups.GroupLinear`), the checkpoint's own
      blocks where `blocks` has them; what is left in float32.
    - bf16 and fp32 keep the table as it is, except bf16's where `blocks` has its groups
      (`reads_blocks`): a `groups.GroupEmbedding` holding exactly the same float32 values.
    Every precision copies the float tensors it keeps from the checkpoint (norms, biases): as views of
    the checkpoint file's pages they would keep every page of the file read so far resident. fp32's and
    bf16's embedding table and untied head stay views (they are read whole, and shared with other processes
    that map the same file)."""
    import torch
    from torch import nn

    from kvfuse.quant import Int8Linear
    from kvfuse.w8a8 import W8A8Linear

    parent_name, _, attr = part.rpartition(".")
    parent = model.get_submodule(parent_name) if parent_name else model
    module = getattr(parent, attr)
    q_rows = (model.block(0).self_attn.q_size,)
    if precision == "int8":
        if isinstance(module, nn.Linear):  # an untied head
            setattr(parent, attr, Int8Linear(module))
        else:  # a layer's linears (a table has none: a tied one comes from `convert_rows`, an untied one stays)
            _replace_linears(module, lambda name, lin: Int8Linear(lin))
    elif precision == "w8a8":
        if isinstance(module, nn.Linear):
            setattr(parent, attr, W8A8Linear(module))
        else:
            _replace_linears(module, lambda name, lin: W8A8Linear(lin, q_rows if name == "qkv_proj" else ()))
    elif precision in ("groups", "lowbit"):
        if part == "embed_tokens" and blocks and f"{part}.weight" in blocks:  # an untied table in its blocks
            setattr(parent, attr, _table(blocks[f"{part}.weight"][0], precision))
        elif isinstance(module, nn.Linear) or part.startswith("layers."):
            setattr(parent, attr, _to_groups(module, part, blocks or {}, precision))
        if precision == "lowbit":
            from kvfuse.lowbit import attention_dtype

            model.attention_dtype = attention_dtype()
    elif part == "embed_tokens" and blocks and f"{part}.weight" in blocks and module.weight.device.type == "cpu":
        from kvfuse.groups import GroupEmbedding

        setattr(model, part, GroupEmbedding(blocks[f"{part}.weight"][0]))
    elif part.startswith("layers."):
        dtype = torch.bfloat16 if precision == "bf16" else torch.float32
        _pack(module.float(), model.block(0).self_attn.q_size, dtype)
        if precision == "bf16" and next(module.parameters()).device.type == "cpu":
            model.attention_dtype = dtype  # a prefill's attention products in bfloat16 too (`Decoder.attend`)
    module = getattr(parent, attr).float()  # int8: the scales stay in the kernel's dtype (`Int8Rows`)
    if part not in ("embed_tokens", "lm_head") or precision in ("int8", "w8a8", "groups", "lowbit"):
        for m in module.modules():
            for p in m.parameters(recurse=False):
                p.data = p.data.clone()


def of(model: Decoder) -> str:
    """The precision a model was converted to."""
    import torch

    from kvfuse.groups import GroupLinear
    from kvfuse.lowbit import LowBitRows
    from kvfuse.packed import PackedLinear
    from kvfuse.quant import Int8Embedding, Int8Linear
    from kvfuse.w8a8 import W8A8Embedding, W8A8Linear

    if any(isinstance(m, LowBitRows) for m in model.modules()):
        return "lowbit"
    if any(isinstance(m, GroupLinear) for m in model.modules()):
        return "groups"
    if any(isinstance(m, W8A8Linear | W8A8Embedding) for m in model.modules()):
        return "w8a8"
    if any(isinstance(m, Int8Linear | Int8Embedding) for m in model.modules()):
        return "int8"
    bf16 = any(isinstance(m, PackedLinear) and m.dtype == torch.bfloat16 for m in model.modules())
    return "bf16" if bf16 else "fp32"


def rounding(model: Decoder) -> torch.dtype:
    """The coarsest dtype the model's computation rounds to: bfloat16 for bf16, and for int8 (its
    kernel reads its input in bfloat16), w8a8 and lowbit (8-bit activation rows, about bfloat16's step); float32
    for fp32 and groups (float32 products of its dequantised weights)."""
    import torch

    return torch.float32 if of(model) in ("fp32", "groups") else torch.bfloat16


def _pack(layer: nn.Module, q_size: int, dtype: torch.dtype) -> None:
    """Prepack a float32 layer's linear weights for oneDNN (`packed.py`) in dtype: decoding steps read
    float32 ones about twice as fast, and bfloat16 ones run on AMX. Where this PyTorch has no oneDNN, or
    the layer is not on the CPU, float32 layers stay plain and bfloat16 ones hold plain bfloat16
    weights. A stacked q/k/v weight is packed in two parts (q; k and v), which `Decoder.query` and
    `key_value` run alone. bfloat16 layers also keep their weights in float16 for decoding steps
    (`PackedLinear.step`), where FBGEMM reads them about twice as fast, and their stacked gate and up
    weight in two parts, whose product `MLP.forward` runs with the activation inside (`PackedLinear.gated`)."""
    import torch

    from kvfuse.packed import PackedLinear, available

    if dtype == torch.bfloat16 or (available() and next(layer.parameters()).device.type == "cpu"):
        q_rows = (q_size,)
        steps = dtype == torch.bfloat16  # and a float16 copy for decoding steps, where FBGEMM runs it

        def splits(name: str, lin: nn.Linear) -> tuple[int, ...]:
            if name == "qkv_proj":
                return q_rows
            return (lin.out_features // 2,) if name == "gate_up_proj" and steps else ()

        _replace_linears(layer, lambda name, lin: PackedLinear(lin, splits(name, lin), dtype, steps))


def _replace_linears(root: nn.Module, make: Callable[[str, nn.Linear], nn.Module]) -> None:
    """Replace every nn.Linear under root, in place, by make(its attribute name, it)."""
    from torch import nn

    for parent in list(root.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.Linear):
                setattr(parent, name, make(name, child))

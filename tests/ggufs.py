"""Tiny random GGUFs of each family kvfuse runs, written with the `gguf` library as llama.cpp's
convert_hf_to_gguf.py writes them: tensors under llama.cpp's names (`gguf.get_tensor_name_map`), a
Llama's q and k rows permuted into llama.cpp's rotary layout, a Gemma's norm weights stored as 1 + w,
the config and a tokenizer (byte-level BPE, or SentencePiece for Gemma) and a chat template in the
metadata. Each writer returns the transformers model it wrote: tests check what reads the file against
it and against transformers' own GGUF loading."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
VOCAB = 300
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-6)


def tiny_hf(family: str, seed: int = 0) -> Any:
    """A random transformers model of the family, its norms random too (so an off-by-one shows)."""
    import transformers as T

    torch.manual_seed(seed)
    if family == "gemma3":
        # head_dim and query_pre_attn_scalar as in every Gemma 3: a GGUF states neither
        model = T.Gemma3ForCausalLM(T.Gemma3TextConfig(vocab_size=VOCAB, head_dim=32, sliding_window=16,
                                                       query_pre_attn_scalar=256, **SHAPE))
    elif family == "qwen3":  # a Qwen3 GGUF's head_dim is read as the family's 128
        model = T.Qwen3ForCausalLM(T.Qwen3Config(vocab_size=VOCAB, head_dim=128, tie_word_embeddings=True,
                                                 **SHAPE))
    elif family == "qwen2":
        model = T.Qwen2ForCausalLM(T.Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=False, **SHAPE))
    elif family in ("llama", "mistral"):  # llama.cpp writes a Mistral as a llama
        model = T.LlamaForCausalLM(T.LlamaConfig(vocab_size=VOCAB, tie_word_embeddings=family == "llama",
                                                 rope_theta=1e6 if family == "mistral" else 1e4, **SHAPE))
    else:
        raise ValueError(family)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.normal_(0.0, 0.3 if "norm" in name else 0.2)
    return model.eval()


def _bytes_to_unicode() -> list[str]:
    """GPT-2's printable stand-in for each byte, in byte order."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs, strict=True))]


def _bpe(writer: Any, pre: str) -> None:
    tokens = _bytes_to_unicode() + ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "Ġt", "he", "Ġthe"]
    tokens += [f"<extra_{i}>" for i in range(VOCAB - len(tokens))]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types([3 if t.startswith("<") and t.endswith(">") else 1 for t in tokens])
    writer.add_token_merges(["Ġ t", "h e", "Ġt he"])
    writer.add_bos_token_id(256)
    writer.add_eos_token_id(258)


def _spm(writer: Any) -> None:
    tokens = ["<pad>", "<eos>", "<bos>", "<unk>", "<|im_start|>", "<|im_end|>"]
    types = [3, 3, 3, 2, 3, 3]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [6] * 256
    words = ["▁", "▁t", "he", "▁the", "e", "t", "h", "a", "c", "▁c", "at", "▁cat"]
    tokens += words + [f"<extra_{i}>" for i in range(VOCAB - len(tokens) - len(words))]
    types += [1] * len(words) + [4] * (VOCAB - len(types) - len(words))
    writer.add_tokenizer_model("llama")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * 262 + [-float(i) for i in range(VOCAB - 262)])
    writer.add_token_types(types)
    writer.add_bos_token_id(2)
    writer.add_eos_token_id(1)
    writer.add_unk_token_id(3)
    writer.add_pad_token_id(0)


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """llama.cpp's rotary layout of a Llama's q or k rows (transformers reverses it when reading)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, family: str, arch: str | None = None, seed: int = 0,
                    quant: dict[str, str] | None = None) -> Any:
    """Write a tiny random model of the family at path; return the transformers model it was written
    from. `arch` overrides the architecture the header names (to write one kvfuse does not run);
    `quant` maps llama.cpp tensor kinds (`attn_q`, `ffn_down`, `token_embd`, ...; `*` for the rest)
    to a quantisation gguf can write (Q8_0, Q4_0, Q4_1, Q5_0, Q5_1): their float weights are not the
    source model's then, but its blocks' dequantisation."""
    import gguf

    model = tiny_hf(family, seed)
    cfg = model.config
    real = "llama" if family == "mistral" else family
    writer = gguf.GGUFWriter(str(path), arch or real)
    writer.add_name("Mistral Tiny" if family == "mistral" else f"tiny {family}")
    writer.add_context_length(cfg.max_position_embeddings)
    writer.add_embedding_length(cfg.hidden_size)
    writer.add_block_count(cfg.num_hidden_layers)
    writer.add_feed_forward_length(cfg.intermediate_size)
    writer.add_head_count(cfg.num_attention_heads)
    writer.add_head_count_kv(cfg.num_key_value_heads)
    writer.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    rope = cfg.rope_parameters
    writer.add_rope_freq_base(float(rope.get("full_attention", rope)["rope_theta"]))
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if family == "gemma3":
        writer.add_sliding_window(cfg.sliding_window)
        _spm(writer)
    else:
        _bpe(writer, "qwen2" if family.startswith("qwen") else "llama-bpe")
    writer.add_chat_template(CHAT_TEMPLATE)
    arch_id = {"llama": gguf.MODEL_ARCH.LLAMA, "qwen2": gguf.MODEL_ARCH.QWEN2, "qwen3": gguf.MODEL_ARCH.QWEN3,
               "gemma3": gguf.MODEL_ARCH.GEMMA3}[real]
    names = gguf.get_tensor_name_map(arch_id, cfg.num_hidden_layers)
    for name, t in model.state_dict().items():
        if name == "lm_head.weight" and cfg.tie_word_embeddings:
            continue
        base, kind = name.rsplit(".", 1)
        data = t.float().numpy()
        if real == "llama" and base.endswith("q_proj"):
            data = _permute(data, cfg.num_attention_heads)
        if real == "llama" and base.endswith("k_proj"):
            data = _permute(data, cfg.num_key_value_heads)
        if family == "gemma3" and base.endswith("norm"):
            data = data + 1.0
        target = names.get_name(base)
        kind_of = target.split(".")[-1] if target.startswith("blk.") else target
        qtype = (quant or {}).get(kind_of, (quant or {}).get("*")) if data.ndim == 2 and "norm" not in target else None
        if qtype is None:
            writer.add_tensor(f"{target}.{kind}", np.ascontiguousarray(data))
        else:
            q = gguf.GGMLQuantizationType[qtype]
            writer.add_tensor(f"{target}.{kind}", gguf.quants.quantize(np.ascontiguousarray(data), q),
                              raw_dtype=q)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return model

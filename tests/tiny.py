"""Tiny random checkpoints of every supported family, written with transformers' own classes."""

from __future__ import annotations

from pathlib import Path

import torch

FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma3")


def hf_config(family: str):  # type: ignore[no-untyped-def]
    import transformers as tf

    common = dict(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=0,
        tie_word_embeddings=False,
    )
    if family == "llama":
        return tf.LlamaConfig(
            **common,
            rope_parameters=dict(
                rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                high_freq_factor=4.0, original_max_position_embeddings=64,
            ),
        )
    if family == "mistral":
        return tf.MistralConfig(**common, sliding_window=7, head_dim=16)
    if family == "qwen2":
        return tf.Qwen2Config(**common, use_sliding_window=False)
    if family == "qwen3":
        return tf.Qwen3Config(**common, head_dim=32)
    if family == "gemma3":
        common.update(tie_word_embeddings=True, head_dim=32)
        return tf.Gemma3TextConfig(
            **common,
            sliding_window=6,
            layer_types=["sliding_attention", "full_attention", "sliding_attention", "full_attention"],
            query_pre_attn_scalar=24,
            hidden_activation="gelu_pytorch_tanh",
            rope_parameters={
                "full_attention": {"rope_type": "default", "rope_theta": 1000000.0},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            },
        )
    raise ValueError(family)


def make_checkpoint(family: str, root: Path, seed: int = 0):  # type: ignore[no-untyped-def]
    """Save a randomly initialised HF model of the family to root; returns the HF model."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = hf_config(family)
    cfg._attn_implementation = "eager"
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    with torch.no_grad():  # perturb every weight so norms and biases are not their trivial init
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    model.save_pretrained(root, safe_serialization=True)
    return model

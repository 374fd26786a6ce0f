"""Model configuration: one dataclass for every supported family, built from a HF config.json.

Behaviour is chosen by per-family flags (qk-norm, sandwich norms, embedding scale, ...), never by
sniffing names at run time; only `from_hf_config` looks at `model_type`, once, to set those flags.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Literal, cast

LayerType = Literal["full", "sliding"]

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gemma3")


class UnsupportedModelError(ValueError):
    """The checkpoint is of a family or RoPE variant kvfuse does not implement."""


class CheckpointError(ValueError):
    """A model directory is missing files or holds tensors that do not fit its config."""


class UnsupportedDeviceError(ValueError):
    """A device torch cannot parse, has no backend for here, or cannot run this precision on."""


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """RoPE parameters of one layer type. `kind` is 'default', 'linear' or 'llama3'."""

    base: float
    kind: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True, slots=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    # per-family flags
    norm_weight_offset: float = 0.0  # Gemma stores RMSNorm weights as w - 1: y = x_hat * (1 + w)
    qk_norm: bool = False  # RMSNorm over head_dim on q and k (Qwen3, Gemma 3)
    sandwich_norm: bool = False  # extra norms after attention and around the MLP (Gemma 3)
    qkv_bias: bool = False  # Qwen2
    activation: Literal["silu", "gelu_tanh"] = "silu"
    embed_scale: float = 1.0  # Gemma multiplies embeddings by sqrt(hidden_size)
    query_scale: float = 0.0  # 0 means head_dim ** -0.5
    attn_softcap: float | None = None
    final_softcap: float | None = None
    layer_types: tuple[LayerType, ...] = ()
    sliding_window: int | None = None  # a sliding layer's query at q sees keys k with q - k < window
    rope_by_type: dict[str, RopeSpec] = field(default_factory=dict)
    tie_embeddings: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    max_position_embeddings: int = 4096
    model_type: str = "llama"

    def __post_init__(self) -> None:
        if not self.layer_types:
            object.__setattr__(self, "layer_types", ("full",) * self.num_layers)
        if not self.query_scale:
            object.__setattr__(self, "query_scale", self.head_dim**-0.5)
        if len(self.layer_types) != self.num_layers:
            raise ValueError(f"layer_types has {len(self.layer_types)} entries for {self.num_layers} layers")
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_heads must be a multiple of num_kv_heads")
        missing = set(self.layer_types) - set(self.rope_by_type)
        if missing:
            raise ValueError(f"no RoPE parameters for layer types {sorted(missing)}")

    def rope(self, layer: int) -> RopeSpec:
        return self.rope_by_type[self.layer_types[layer]]

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.layer_types[layer] == "sliding" else None

    @property
    def kv_bytes_per_token(self) -> int:
        """Bytes of K and V for one token over all layers, in fp32."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * 4

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> ModelConfig:
        """Build a config from the dict in a HF checkpoint's config.json (transformers 4.x or 5.x layout)."""
        model_type = hf.get("model_type", "")
        if model_type == "gemma3":  # multimodal wrapper: the text part is what we run
            hf = {**hf["text_config"], "model_type": "gemma3_text"}
            model_type = "gemma3_text"
        if model_type not in SUPPORTED_MODEL_TYPES:
            raise UnsupportedModelError(
                f"model_type {model_type!r} is not supported; kvfuse runs {', '.join(SUPPORTED_MODEL_TYPES)}"
            )
        gemma = model_type == "gemma3_text"
        n_layers = hf["num_hidden_layers"]
        n_heads = hf["num_attention_heads"]
        head_dim = hf.get("head_dim") or hf["hidden_size"] // n_heads
        layer_types = _layer_types(hf, model_type, n_layers)
        eos = hf.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        act = hf.get("hidden_activation") or hf.get("hidden_act") or "silu"
        if act not in ("silu", "gelu_pytorch_tanh"):
            raise UnsupportedModelError(f"activation {act!r} is not supported")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=n_layers,
            num_heads=n_heads,
            num_kv_heads=hf.get("num_key_value_heads") or n_heads,
            head_dim=head_dim,
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            norm_weight_offset=1.0 if gemma else 0.0,
            qk_norm=model_type in ("qwen3", "gemma3_text"),
            sandwich_norm=gemma,
            qkv_bias=model_type == "qwen2" or bool(hf.get("attention_bias", False)),
            activation="gelu_tanh" if act == "gelu_pytorch_tanh" else "silu",
            embed_scale=math.sqrt(hf["hidden_size"]) if gemma else 1.0,
            query_scale=hf["query_pre_attn_scalar"] ** -0.5 if gemma else 0.0,
            attn_softcap=hf.get("attn_logit_softcapping"),
            final_softcap=hf.get("final_logit_softcapping"),
            layer_types=layer_types,
            sliding_window=hf.get("sliding_window") if "sliding" in layer_types else None,
            rope_by_type=_rope_specs(hf, gemma, set(layer_types)),
            tie_embeddings=hf.get("tie_word_embeddings", gemma),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=eos_ids,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            model_type=model_type,
        )


def _layer_types(hf: dict[str, Any], model_type: str, n_layers: int) -> tuple[LayerType, ...]:
    names = hf.get("layer_types")
    if names:
        return tuple(cast(LayerType, "sliding" if t == "sliding_attention" else "full") for t in names)
    window = hf.get("sliding_window")
    if model_type == "gemma3_text":
        pattern = hf.get("sliding_window_pattern") or hf.get("_sliding_window_pattern") or 6
        return tuple(cast(LayerType, "full" if (i + 1) % pattern == 0 else "sliding") for i in range(n_layers))
    if model_type == "mistral" and window:
        return cast(tuple[LayerType, ...], ("sliding",) * n_layers)
    if model_type in ("qwen2", "qwen3") and hf.get("use_sliding_window") and window:
        first = hf.get("max_window_layers", n_layers)
        return tuple(cast(LayerType, "sliding" if i >= first else "full") for i in range(n_layers))
    return cast(tuple[LayerType, ...], ("full",) * n_layers)


def _rope_spec(params: dict[str, Any] | None, base: float) -> RopeSpec:
    params = dict(params or {})
    kind = params.get("rope_type", params.get("type", "default"))
    base = params.get("rope_theta", base)
    if kind == "default":
        return RopeSpec(base=base)
    if kind == "linear":
        return RopeSpec(base=base, kind="linear", factor=float(params["factor"]))
    if kind == "llama3":
        return RopeSpec(
            base=base,
            kind="llama3",
            factor=float(params["factor"]),
            low_freq_factor=float(params["low_freq_factor"]),
            high_freq_factor=float(params["high_freq_factor"]),
            original_max_position=int(params["original_max_position_embeddings"]),
        )
    raise UnsupportedModelError(f"RoPE type {kind!r} is not supported (default, linear and llama3 are)")


def _rope_specs(hf: dict[str, Any], gemma: bool, types: set[str]) -> dict[str, RopeSpec]:
    params = hf.get("rope_parameters")
    if params and ("full_attention" in params or "sliding_attention" in params):
        # transformers 5 layout, nested by layer type
        return {t: _rope_spec(params[t + "_attention"], 10000.0) for t in types}
    base = hf.get("rope_theta", 10000.0)
    scaling = params or hf.get("rope_scaling")
    full = _rope_spec(scaling, base)
    if gemma:  # sliding layers use the local base and no scaling
        return {"full": full, "sliding": RopeSpec(base=hf.get("rope_local_base_freq", 10000.0))}
    return {t: full for t in types}

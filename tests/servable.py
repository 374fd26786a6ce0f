"""A tiny random checkpoint that `kvfuse serve` can load in its own process: the tiny Gemma 3 with a
character tokenizer saved beside it (HF's fast tokenizer format), so replicas, routers and Redis can be
tested end to end in seconds."""

from __future__ import annotations

import shutil
from pathlib import Path


def servable_checkpoint(tiny_root: Path, out: Path) -> Path:
    """Copy a tiny checkpoint to `out` and save a character-level tokenizer with it."""
    from tokenizers import Tokenizer, decoders, models
    from transformers import PreTrainedTokenizerFast

    shutil.copytree(tiny_root, out, dirs_exist_ok=True)
    chars = ["\n"] + [chr(c) for c in range(32, 127)]
    vocab = {"<pad>": 0, "<bos>": 1, "<eos>": 2, **{c: 3 + i for i, c in enumerate(chars)}}
    vocab["<unk>"] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()  # characters joined as they are, no spaces between them
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.save_pretrained(out)
    return out

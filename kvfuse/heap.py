"""Handing freed heap memory back to the system after a large load (the checkpoint, the tokenizer)."""

from __future__ import annotations


def return_freed_memory() -> None:
    """Return the heap's free pages to the system (glibc's malloc_trim; nothing elsewhere). A load that
    builds and frees large temporaries leaves them in glibc's heap, counted in RSS until reused."""
    import ctypes

    try:
        ctypes.CDLL(None).malloc_trim(0)
    except (OSError, AttributeError):
        pass

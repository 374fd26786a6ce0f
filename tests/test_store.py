import torch

from kvfuse.kv import KVCache
from kvfuse.store.keys import chunk_key, hash_block_tokens, prefix_block_hashes, root_hash
from kvfuse.store.memory import MemoryTier


def _cache(n: int, layers: int = 2) -> KVCache:
    k = torch.randn(layers, 1, n, 4)
    return KVCache(k, k.clone(), torch.arange(n))


def test_kv_cache_value_api() -> None:
    a, b = _cache(3), _cache(5)
    ab = KVCache.concat([a, b])
    assert len(ab) == 8 and ab.nbytes == a.nbytes + b.nbytes
    assert torch.equal(ab.slice(3, 8).k, b.k)
    assert ab.to(torch.bfloat16).dtype == torch.bfloat16
    c = a.clone()
    c.k += 1
    assert not torch.equal(c.k, a.k)


def test_chunk_keys_cover_model_dtype_preamble_and_tokens() -> None:
    base = chunk_key("fp", torch.float32, (2,), (5, 6, 7))
    assert base == chunk_key("fp", torch.float32, (2,), [5, 6, 7])
    others = [
        chunk_key("other", torch.float32, (2,), (5, 6, 7)),
        chunk_key("fp", torch.bfloat16, (2,), (5, 6, 7)),
        chunk_key("fp", torch.float32, (), (5, 6, 7)),
        chunk_key("fp", torch.float32, (2,), (5, 6, 8)),
    ]
    assert len({base, *others}) == 5


def test_prefix_block_hashes_are_chained() -> None:
    root = root_hash("fp", torch.float32)
    a = prefix_block_hashes(root, list(range(40)), 16)
    assert len(a) == 2  # the partial third block is not cacheable
    b = prefix_block_hashes(root, [99] + list(range(1, 40)), 16)
    assert a[0] != b[0] and a[1] != b[1]  # a change early changes every later hash
    c = prefix_block_hashes(root, list(range(16)) + [99] * 24, 16)
    assert a[0] == c[0] and a[1] != c[1]
    assert prefix_block_hashes(root, list(range(40)), 16, ("tenant-a",))[0] != a[0]
    assert hash_block_tokens(root, [1, 2]) == hash_block_tokens(root, [1, 2])


def test_memory_tier_is_lru_by_bytes_and_keeps_pins() -> None:
    one = _cache(4).nbytes
    tier = MemoryTier(capacity_bytes=3 * one)
    for key in "abc":
        assert tier.put(key, _cache(4))  # type: ignore[arg-type]
    tier.pin("a")  # type: ignore[arg-type]
    assert tier.get("b") is not None  # type: ignore[arg-type]  # b is now more recent than c
    tier.put("d", _cache(4))  # type: ignore[arg-type]
    assert "c" not in tier and {"a", "b", "d"} <= set(tier.keys())
    assert tier.used_bytes <= tier.capacity_bytes and tier.stats.evictions == 1
    assert not tier.put("huge", _cache(40))  # type: ignore[arg-type]
    assert tier.get("zzz") is None and tier.stats.misses == 1  # type: ignore[arg-type]


def test_a_prefix_tail_has_a_key_no_full_block_has() -> None:
    from kvfuse.store.keys import SaltRange, tail_block_hash

    root = root_hash("m", torch.float32)
    toks = list(range(40))
    hashes = prefix_block_hashes(root, toks, 16)
    tail = tail_block_hash(hashes[-1], toks, 16)
    assert tail is not None and tail not in hashes
    assert tail_block_hash(hashes[-1], toks[:32], 16) is None  # on a block boundary: no tail
    longer = prefix_block_hashes(root, toks + list(range(100, 108)), 16)  # the tail's block filled
    assert tail not in longer and longer[:2] == hashes
    assert tail_block_hash(hashes[-1], toks[:39] + [99], 16) != tail  # its tokens
    assert tail_block_hash(hashes[0], toks, 16) != tail  # what it follows
    assert tail_block_hash(hashes[-1], toks, 16, salts=[SaltRange(35, 40, "tenant:a")]) != tail  # its salts

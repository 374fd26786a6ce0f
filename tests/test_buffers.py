"""KV buffers kept between requests (`fuse.buffers`): reused only once nobody reads them, and a prefix
already in place is skipped, never wrongly."""

import pytest
import torch
from conftest import rand_ids

from kvfuse import fuse
from kvfuse.engine import Engine, Request
from kvfuse.engine.sampling import SamplingParams
from kvfuse.fuse.buffers import COUNTS, POOL, BufferPool
from kvfuse.kv import KVCache

SHAPE = (2, 1, 40, 8)

pytestmark = pytest.mark.skipif(not COUNTS, reason="this PyTorch cannot count storage users")


def _blocks(n: int, seed: int) -> list[KVCache]:
    g = torch.Generator().manual_seed(seed)
    return [KVCache(torch.randn(2, 1, 4, 8, generator=g), torch.randn(2, 1, 4, 8, generator=g), torch.arange(4))
            for _ in range(n)]


def test_a_buffer_comes_back_only_when_nobody_views_it() -> None:
    pool = BufferPool(keep=2)
    a = pool.take(SHAPE, torch.float32, torch.device("cpu"))
    ptr = a.k.data_ptr()
    view = a.k[:, :, :3]
    del a
    b = pool.take(SHAPE, torch.float32, torch.device("cpu"))  # the first is still viewed: a new pair
    assert b.k.data_ptr() != ptr
    del view
    c = pool.take((2, 1, 30, 8), torch.float32, torch.device("cpu"))  # now free, and long enough
    assert c.k.data_ptr() in (ptr, b.k.data_ptr()) and c.k.shape == (2, 1, 30, 8)
    assert c.k.data_ptr() == ptr  # b is still held here
    d = pool.take(SHAPE, torch.float32, torch.device("cpu"))  # both busy and the pool full: one of its own
    assert d.entry is None and d.k.data_ptr() not in (ptr, b.k.data_ptr())


def test_blocks_already_in_place_are_counted_by_identity_and_position() -> None:
    pool = BufferPool(keep=1)
    blocks = _blocks(5, 1)
    a = pool.take(SHAPE, torch.float32, torch.device("cpu"), blocks)
    assert a.done == 0
    a.holds(blocks)
    del a
    b = pool.take(SHAPE, torch.float32, torch.device("cpu"), blocks[:3] + _blocks(2, 2))
    assert b.done == 3  # the same first three objects; the rest differ
    b.holds(blocks[:3])
    del b
    copies = [KVCache(c.k.clone(), c.v.clone(), c.positions) for c in blocks]  # equal values, other objects
    c = pool.take(SHAPE, torch.float32, torch.device("cpu"), copies)
    assert c.done == 0
    del c  # (c held nothing: it recorded no blocks)
    d = pool.take(SHAPE, torch.float32, torch.device("cpu"), blocks)
    assert d.done == 0  # c's lease truncated the record to what it matched: nothing


def test_prefix_prefills_from_kept_buffers_equal_fresh_ones(tiny_models) -> None:
    """The same prefix blocks prefilled again (in place in a kept buffer), after a prompt that shares only
    some of them, and while an earlier cache is still read: every cache is bitwise the one new buffers
    give (the same prefill with the pool emptied first)."""
    from kvfuse.weights import load_model

    m = load_model(tiny_models["gemma3"][0]).model
    ids = torch.tensor(rand_ids(60, 3))
    blocks = [fuse.prefill(m, ids[:16]).cache]
    for s in range(16, 48, 16):
        blocks.append(fuse.prefill(m, ids[s : s + 16], past=blocks).cache.slice(s, s + 16).clone())
    other = torch.tensor(rand_ids(12, 9))

    def same(got: fuse.Fused, want: fuse.Fused) -> bool:
        return torch.equal(got.cache.k, want.cache.k) and torch.equal(got.cache.v, want.cache.v) \
            and torch.equal(got.logits, want.logits)

    with torch.inference_mode():
        POOL.clear()
        want = fuse.prefill(m, ids[48:], past=blocks, room=4)
        POOL.clear()
        want_mixed = fuse.prefill(m, other, past=blocks[:2], room=4)
        POOL.clear()
        first = fuse.prefill(m, ids[48:], past=blocks, room=4)
        held = first.cache  # still read: its buffers are not handed out
        del first
        busy = fuse.prefill(m, ids[48:], past=blocks, room=4)  # a second pair
        assert torch.equal(held.k, want.cache.k) and same(busy, want)
        del held, busy
        mixed = fuse.prefill(m, other, past=blocks[:2], room=4)  # a kept pair: its first two blocks in place
        twice = fuse.prefill(m, ids[48:], past=blocks, room=4)  # the other kept pair: all three in place
        assert same(mixed, want_mixed) and same(twice, want)
        del mixed
        thrice = fuse.prefill(m, ids[48:], past=blocks, room=4)  # mixed's pair: two in place, the third copied
        assert same(thrice, want)
    POOL.clear()


def test_questions_on_a_stored_prefix_answer_as_with_fresh_buffers(tiny_engines) -> None:
    """Prefix-mode requests on two stored prefixes of one length, taking turns, one after another and two
    at once, get the tokens a cold pool gives each alone."""
    e: Engine = tiny_engines["llama"]
    prefixes = [(1,) + rand_ids(63, 5), (1,) + rand_ids(63, 6)]
    reqs = [Request(prefix=prefixes[s % 2], chunks=(), suffix=rand_ids(5, s)) for s in range(4)]
    for r in reqs[:2]:
        e.precompute(r, "prefix")
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    want = []
    for r in reqs:
        POOL.clear()
        want.append(e.generate(r, "prefix", None, params).tokens)
    POOL.clear()
    got = [e.generate(r, "prefix", None, params).tokens for r in reqs]
    batch = [e.begin(r, "prefix", None, params) for r in reqs[:3]]
    while not all(d.done for d in batch):
        e.advance(batch)
    assert got == want and [d.close().tokens for d in batch] == want[:3]


def test_a_kept_buffer_does_not_keep_the_blocks_it_holds_alive() -> None:
    """An evicted block, or a converted copy made for one request, is freed: the record matches nothing."""
    import gc
    import weakref

    pool = BufferPool(keep=1)
    blocks = _blocks(3, 4)
    a = pool.take(SHAPE, torch.float32, torch.device("cpu"), blocks)
    a.holds(blocks)
    del a
    alive = weakref.ref(blocks[0].k)
    del blocks
    gc.collect()
    assert alive() is None
    assert pool.take(SHAPE, torch.float32, torch.device("cpu"), _blocks(3, 4)).done == 0  # equal values, new objects


def test_a_stored_prefix_kept_in_another_dtype_is_found_in_place(engine_at, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """bf16's blocks are stored in bfloat16 and its buffers are float32: the next question on the prefix
    still finds every block in place (none is copied again) and answers as from fresh buffers."""
    import kvfuse.fuse.core as fcore

    e: Engine = engine_at("gemma3", "bf16")
    assert e.kv_dtype == torch.bfloat16 != e.model.compute_dtype
    copied: list[int] = []
    copy_in = fcore._copy_in

    def counting(parts, bufs):  # type: ignore[no-untyped-def]
        copied.append(len(parts) - bufs.done)
        return copy_in(parts, bufs)

    monkeypatch.setattr(fcore, "_copy_in", counting)
    prefix = (1,) + rand_ids(63, 11)
    reqs = [Request(prefix=prefix, chunks=(), suffix=rand_ids(5, 20 + s)) for s in range(2)]
    e.precompute(reqs[0], "prefix")
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    POOL.clear()
    copied.clear()
    want = [e.generate(r, "prefix", None, params).tokens for r in reqs]
    assert copied[0] == 4 and copied[1] == 0, copied  # 4 blocks copied into the first buffer, none after
    POOL.clear()
    assert e.generate(reqs[1], "prefix", None, params).tokens == want[1]
    POOL.clear()

"""KVSlotAllocator: slots handed out once until freed, counts exact, and a free's cost independent of
the pool's size (the free list is not copied per free)."""

import random

import pytest
import torch

from worker_svc.kvcache.allocator import KVSlotAllocator


def test_alloc_free_round_trip_keeps_every_slot_once():
    alloc = KVSlotAllocator(100)
    rng = random.Random(0)
    held: list[torch.Tensor] = []
    for _ in range(2000):
        if held and rng.random() < 0.5:
            alloc.free(held.pop(rng.randrange(len(held))))
        else:
            got = alloc.alloc(rng.randrange(0, 12))
            if got is None:
                continue
            held.append(got)
        owned = [s for t in held for s in t.tolist()]
        free = alloc.free_slots().tolist()
        assert alloc.available() == len(free) == 100 - len(owned)
        assert sorted(free + owned) == list(range(1, 101))  # slot 0 is the padding slot, never handed out


def test_alloc_refuses_what_it_cannot_give_and_takes_nothing():
    alloc = KVSlotAllocator(8)
    first = alloc.alloc(5)
    assert first is not None and first.tolist() == [1, 2, 3, 4, 5]
    assert alloc.alloc(4) is None
    assert alloc.available() == 3
    alloc.free(first[1:3])
    got = alloc.alloc(5)  # spans the rest of the first chunk and the freed one
    assert got is not None and sorted(got.tolist()) == [2, 3, 6, 7, 8]
    assert alloc.available() == 0
    assert alloc.alloc(0).numel() == 0
    assert alloc.alloc(1) is None


def test_free_copies_the_callers_tensor():
    alloc = KVSlotAllocator(4)
    slots = alloc.alloc(2)
    assert slots is not None
    mine = slots.clone()
    alloc.free(mine)
    mine.fill_(0)  # the caller reuses its buffer: the allocator's free list must not change
    assert sorted(alloc.free_slots().tolist()) == [1, 2, 3, 4]


def test_clear_restores_the_full_pool():
    alloc = KVSlotAllocator(10)
    alloc.alloc(7)
    alloc.clear()
    assert alloc.available() == 10
    assert alloc.free_slots().tolist() == list(range(1, 11))


def test_many_small_frees_are_merged():
    alloc = KVSlotAllocator(64, max_chunks=8)
    singles = [alloc.alloc(1) for _ in range(64)]
    for s in singles:
        alloc.free(s)
    assert len(alloc._chunks) <= 8
    assert sorted(alloc.free_slots().tolist()) == list(range(1, 65))


def test_free_does_not_copy_the_free_list(monkeypatch):
    """Regression: free() used to torch.cat the whole free list with the freed slots, O(pool) per
    finished request. Now nothing the size of the pool is built on free."""
    alloc = KVSlotAllocator(1 << 20)
    slots = alloc.alloc(16)
    assert slots is not None
    sizes: list[int] = []
    real_cat = torch.cat

    def counting_cat(tensors, *args, **kwargs):
        out = real_cat(tensors, *args, **kwargs)
        sizes.append(out.numel())
        return out

    monkeypatch.setattr(torch, "cat", counting_cat)
    alloc.free(slots)
    assert max(sizes, default=0) <= 16


@pytest.mark.parametrize("size", [0, -1])
def test_an_empty_or_negative_pool_is_refused(size):
    with pytest.raises(ValueError, match="positive"):
        KVSlotAllocator(size)

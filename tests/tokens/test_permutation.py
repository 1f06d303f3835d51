"""permutation.py: a seeded bijection on 0..n-1, computed element by element; and the block-wise
order that reads a set of shards a few at a time."""
import subprocess
import sys

import numpy as np
import pytest
import torch

from mingpt.tokens.permutation import BlockOrder, Blocks, Permutation


@pytest.mark.parametrize("n", [1, 2, 3, 7, 64, 65, 1000, 5385, 100_003])
def test_every_element_appears_exactly_once(n):
    order = Permutation(n, seed=1337)(torch.arange(n))
    assert torch.equal(order.sort().values, torch.arange(n))


def test_the_seed_decides_the_order():
    positions = torch.arange(1000)
    same = Permutation(1000, 5)(positions)
    assert torch.equal(same, Permutation(1000, 5)(positions))
    assert not torch.equal(same, Permutation(1000, 6)(positions))
    assert not torch.equal(same, positions)


def test_positions_can_be_asked_in_any_order_and_shape():
    perm = Permutation(500, 3)
    whole = perm(torch.arange(500))
    picked = torch.tensor([[499, 0], [17, 250]])
    assert torch.equal(perm(picked), whole[picked])
    with pytest.raises(IndexError):
        perm(torch.tensor([500]))


def test_shuffles_fairly():
    """Where element 0 lands over many seeds: every position about equally often."""
    landing = torch.stack([(Permutation(8, seed)(torch.arange(8)) == 0).nonzero()[0, 0]
                           for seed in range(4000)])
    counts = torch.bincount(landing, minlength=8).float()
    assert counts.min() > 0.8 * 500 and counts.max() < 1.2 * 500


def test_a_billion_elements_need_no_list():
    perm = Permutation(10**9, 1)
    first = perm(torch.arange(100_000))
    assert first.unique().numel() == 100_000 and int(first.max()) < 10**9


@pytest.mark.slow
def test_the_same_order_in_another_process():
    code = ("import torch; from mingpt.tokens.permutation import Permutation;"
            "print(Permutation(12345, 99)(torch.arange(0, 12345, 97)).tolist())")
    other = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert eval(other) == Permutation(12345, 99)(torch.arange(0, 12345, 97)).tolist()


def test_the_order_is_the_one_earlier_versions_computed():
    """A snapshot holds a position in an epoch's order, so a run resumed by a newer version must
    continue the same order: these values were computed by the version that first wrote them."""
    assert Permutation(5385, 1337 + 1_000_003)(torch.arange(0, 5385, 500)).tolist() == [
        3929, 3027, 2491, 1621, 5292, 1507, 40, 1573, 2786, 3592, 3339]
    assert Permutation(10**9, 7)(torch.tensor([0, 1, 999_999_999])).tolist() == [
        395683348, 712876305, 123346677]


def test_a_block_order_reads_each_sample_once_a_group_of_blocks_at_a_time():
    sizes = [50, 0, 70, 30, 90, 10, 40]
    order = BlockOrder(Blocks(sizes, at_once=2), seed=3)
    samples = order(np.arange(order.n)).numpy()
    assert sorted(samples) == list(range(sum(sizes)))
    block_of = np.searchsorted(np.cumsum(sizes), samples, side="right")  # each sample's block
    for group, (start, end) in enumerate(zip(order.group_starts[:-1], order.group_starts[1:])):
        assert set(block_of[start:end]) <= set(order.groups[group]) and len(order.groups[group]) <= 2
        if len(set(block_of[start:end])) > 1:  # (a group of block 1, empty, holds one block's samples)
            assert list(block_of[start:end]) != sorted(block_of[start:end])  # mixed within the group
    assert [order.group_at(int(p)) for p in order.group_starts[:-1]] == list(range(len(order.groups)))
    assert order.blocks_from(0) == [*order.groups[0], *order.groups[1]]


def test_a_block_order_is_fixed_by_its_seed_and_read_in_any_shape():
    blocks = Blocks([40, 60, 25], at_once=1)
    order = BlockOrder(blocks, seed=5)
    whole = order(np.arange(125))
    assert torch.equal(whole, BlockOrder(blocks, seed=5)(np.arange(125)))
    assert not torch.equal(whole, BlockOrder(blocks, seed=6)(np.arange(125)))
    assert torch.equal(order(np.arange(125).reshape(5, 25)), whole.reshape(5, 25))
    with pytest.raises(IndexError):
        order(np.array([125]))

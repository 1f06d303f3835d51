"""permutation.py: a seeded bijection on 0..n-1, computed element by element."""
import subprocess
import sys

import pytest
import torch

from mingpt.tokens.permutation import Permutation


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

"""Bitwise comparison of model and optimizer states (nested dicts and lists of tensors and values)."""
import torch


def assert_same_state(actual, expected, where: str = "state") -> None:
    """Equal keys, equal plain values, and tensors of equal dtype, shape and bits."""
    if isinstance(expected, dict):
        assert isinstance(actual, dict) and actual.keys() == expected.keys(), f"{where}: other keys"
        for key in expected:
            assert_same_state(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(actual) == len(expected), f"{where}: other length"
        for index, (a, e) in enumerate(zip(actual, expected)):
            assert_same_state(a, e, f"{where}[{index}]")
    elif isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: not a tensor"
        assert actual.dtype == expected.dtype and torch.equal(actual, expected), f"{where}: other values"
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"

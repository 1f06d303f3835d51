"""Fixtures shared by the tests (helpers.py holds the plain functions)."""
from pathlib import Path

import pytest

from helpers import make_text


@pytest.fixture(scope="session")
def text_file(tmp_path_factory) -> Path:
    """A 6,000-character generated text, so that tests run anywhere."""
    path = tmp_path_factory.mktemp("data") / "input.txt"
    path.write_text(make_text(6000))
    return path

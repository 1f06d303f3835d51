"""errors.py: a user's error is one line, in one write, exit status 1."""
import sys

import pytest
from helpers import Writes

from mingpt.common.errors import ConfigError, DataError, command, say_error


def test_every_error_line_is_one_write(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)
    say_error(ConfigError("trainer_config.batch_size", "must be positive, got 0"), origin="[rank 1] ")
    assert stderr.writes == ["error: [rank 1] trainer_config.batch_size: must be positive, got 0\n"]


def test_a_command_says_a_users_error_once_and_exits_1(monkeypatch):
    stderr = Writes()
    monkeypatch.setattr(sys, "stderr", stderr)

    @command
    def refuses():
        raise DataError("data_config.path: no such file /x; give a text")

    with pytest.raises(SystemExit) as exited:
        refuses()
    assert exited.value.code == 1
    assert stderr.writes == ["error: data_config.path: no such file /x; give a text\n"]

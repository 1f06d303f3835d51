"""common/logger.py: the project's one logger."""
import io
import sys

from mingpt.common import logger


def test_lines_go_to_stdout_as_it_is_when_they_are_said(monkeypatch, capsys):
    """A stdout replaced after logging was configured (a test's capture that has since closed) gets
    no line and raises nothing: each line goes to sys.stdout of its moment."""
    earlier = io.StringIO()
    monkeypatch.setattr(sys, "stdout", earlier)
    logger.configure_logging(0)
    earlier.close()
    monkeypatch.undo()
    logger.log.warning("said after the capture closed")
    out, err = capsys.readouterr()
    assert out == "warning: said after the capture closed\n" and "Logging error" not in err

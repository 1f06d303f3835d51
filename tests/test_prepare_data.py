"""prepare_data.py, the command: a token file made ahead of training, and its one-line errors."""
import re
import sys

from helpers import MINGPT, REPO, make_text, run


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


def test_cli_prepares_then_finds_it_up_to_date(tmp_path):
    source = write(tmp_path / "input.txt", make_text(6000))
    result = run([sys.executable, MINGPT / "prepare_data.py", source])
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"prepared {re.escape(source)}\.tokens: 6,000 tokens, vocabulary of \d+, "
                        r"[\d.]+ MB/s\n", result.stdout)
    result = run([sys.executable, "prepare_data.py", source], cwd=MINGPT)  # from inside mingpt/
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"up to date: {source}.tokens: 6,000 tokens")


def test_cli_errors_are_one_line_and_exit_1(tmp_path):
    result = run([sys.executable, MINGPT / "prepare_data.py", tmp_path / "missing.txt"])
    assert result.returncode == 1 and result.stdout == ""
    assert re.fullmatch(r"error: data_config.path: no such file .*\n", result.stderr)
    result = run([sys.executable, MINGPT / "prepare_data.py"], cwd=REPO)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "see --help" in result.stderr

"""prepare_data.py, the command: a token file made ahead of training, and its one-line errors."""
import re
import sys

import pytest
from helpers import MINGPT, REPO, make_text, run, write_llmc_shard

from mingpt import prepare_data


def write(path, text: str) -> str:
    path.write_text(text, encoding="utf-8")
    return str(path)


@pytest.mark.slow
def test_cli_prepares_then_finds_it_up_to_date(tmp_path):
    source = write(tmp_path / "input.txt", make_text(6000))
    result = run([sys.executable, MINGPT / "prepare_data.py", source])
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"prepared {re.escape(source)}\.tokens: 6,000 tokens, vocabulary of \d+, "
                        r"[\d.]+ MB/s\n", result.stdout)
    result = run([sys.executable, "prepare_data.py", source], cwd=MINGPT)  # from inside mingpt/
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"up to date: {source}.tokens: 6,000 tokens")


@pytest.mark.slow
def test_cli_errors_are_one_line_and_exit_1(tmp_path):
    result = run([sys.executable, MINGPT / "prepare_data.py", tmp_path / "missing.txt"])
    assert result.returncode == 1 and result.stdout == ""
    assert re.fullmatch(r"error: data_config.path: no such file .*\n", result.stderr)
    result = run([sys.executable, MINGPT / "prepare_data.py"], cwd=REPO)
    assert result.returncode == 1 and result.stderr.startswith("error: ") and "see --help" in result.stderr


def test_shards_need_nothing_but_their_headers_are_checked(tmp_path, capsys):
    """In this process (the command's shell is the same): nothing is written beside the shards."""
    for i in range(2):
        write_llmc_shard(tmp_path / f"fineweb_train_{i:06d}.bin", range(100))
    pattern = str(tmp_path / "fineweb_train_*.bin")
    prepare_data.main([pattern])
    said = capsys.readouterr().out
    assert said == f"nothing to prepare: {pattern} is 2 llm.c shards, 200 tokens, read as they lie " \
                   "(headers checked)\n"
    assert len(list(tmp_path.iterdir())) == 2
    write_llmc_shard(tmp_path / "fineweb_train_000002.bin", range(100), version=2)
    with pytest.raises(SystemExit) as refused:
        prepare_data.main([pattern])
    error = capsys.readouterr().err
    assert refused.value.code == 1 and error.count("\n") == 1
    bad = tmp_path / "fineweb_train_000002.bin"
    assert error.startswith(f"error: data_config.path: {bad} is of version 2 ")


def test_on_a_terminal_a_set_is_shown_as_one_progress_bar(tmp_path):
    """A terminal (a pseudo-terminal here) gets one bar counting the files of both processes to the
    total, in place of a line per file made; the summary line stays."""
    import os
    import pty

    from mingpt.tokens.tokenizer import train_bpe

    folder = tmp_path / "set"
    folder.mkdir()
    for index in range(6):
        (folder / f"part_{index}.txt").write_text(make_text(800, seed=index))
    tokenizer = tmp_path / "tokenizer.json"
    train_bpe(iter([make_text(3000)]), vocab_size=300).save(str(tokenizer))
    pid, terminal = pty.fork()
    if pid == 0:  # the child: the command, its stdout and stderr the terminal
        os.execv(sys.executable, [sys.executable, str(MINGPT / "prepare_data.py"), str(folder),
                                  "--tokenizer", str(tokenizer), "--processes", "2"])
    shown = b""
    while True:
        try:
            chunk = os.read(terminal, 4096)
        except OSError:  # the child has ended: the terminal is closed
            break
        if not chunk:
            break
        shown += chunk
    _, status = os.waitpid(pid, 0)
    text = shown.decode()
    assert os.waitstatus_to_exitcode(status) == 0, text
    assert "\r6/6 files [" + "#" * 30 + "] 100%" in text, text
    assert "prepared " + str(folder) not in text  # no line per file
    assert re.search(r"6 files: 6 prepared now, 0 up to date; [\d,]+ tokens", text), text

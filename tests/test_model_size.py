"""model_size.py: parameter counts and state sizes of the settings, and the command itself."""
import subprocess
import sys

from helpers import MINGPT

from mingpt.model import PRESETS
from mingpt.model_size import measure, table


def test_default_model_size_matches_the_original():
    params, state_bytes = measure(8, 8, 512, vocab_size=65, block_size=128)
    assert params == 25_352_192
    assert state_bytes == 4 * params  # fp32, no buffers


def test_table_lists_every_setting():
    text = table(vocab_size=65, block_size=128)
    for name in PRESETS:
        assert name in text
    assert "25,352,192" in text


def test_the_command_goes_quietly_when_its_reader_does():
    """`python model_size.py | head -1`: the reader closes the pipe before the table is written;
    the command ends without a BrokenPipeError traceback (from inside mingpt/, as users run it)."""
    process = subprocess.Popen([sys.executable, "model_size.py"], cwd=MINGPT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    _, stderr = process.communicate(timeout=60)
    assert stderr == "" and process.returncode == 1  # the table itself: the tests above

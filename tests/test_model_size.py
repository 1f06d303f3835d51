"""model_size.py: parameter counts and state sizes of the settings, and the command itself."""
import subprocess
import sys

import pytest
from helpers import MINGPT

from mingpt.model import PRESETS
from mingpt.model_size import measure, table


def test_default_model_size_matches_the_original():
    params, state_bytes = measure(8, 8, 512, vocab_size=65, block_size=128)
    assert params == 25_352_192
    padding = (128 - 65) * 512 * 2  # the embedding's and the head's rows up to a multiple of 64
    assert state_bytes == 4 * (params + padding)  # fp32, no buffers


def test_table_lists_every_setting():
    text = table(vocab_size=65, block_size=128)
    for name in PRESETS:
        assert name in text
    assert "25,352,192" in text


@pytest.mark.slow
def test_the_command_goes_quietly_when_its_reader_does():
    """`python model_size.py | head -1`: the reader closes the pipe before the table is written;
    the command ends without a BrokenPipeError traceback (from inside mingpt/, as users run it)."""
    process = subprocess.Popen([sys.executable, "model_size.py"], cwd=MINGPT, stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True)
    process.stdout.close()
    _, stderr = process.communicate(timeout=60)
    assert stderr == "" and process.returncode == 1  # the table itself: the tests above


def test_overrides_add_the_row_of_the_model_they_configure(capsys):
    """As every other command, it takes main.py's overrides: their model gets a row of its own."""
    from mingpt.model_size import main

    main(["--vocab-size", "65", "gpt_config.model_type=gpt-mini", "gpt_config.n_layer=null",
          "gpt_config.n_head=null", "gpt_config.n_embd=null", "data_config.block_size=64"])
    rows = capsys.readouterr().out.splitlines()
    assert rows[-1].split()[:5] == ["your", "overrides", "6", "6", "192"]
    expected, _ = measure(6, 6, 192, vocab_size=65, block_size=64)
    assert f"{expected:,}" in rows[-1]
    with pytest.raises(SystemExit):
        main(["gpt_config.n_layr=3"])
    assert capsys.readouterr().err.startswith("error: gpt_config.n_layr: is not a key of GPTConfig (did you mean "
                                              "gpt_config.n_layer?)")


def test_a_config_of_your_own_adds_its_row(capsys):
    """`--config-name laptop`, as main.py takes it: the laptop model (4 layers, 128 wide, block 64)."""
    from mingpt.model_size import main

    main(["--config-name", "laptop"])
    assert capsys.readouterr().out.splitlines()[-1].split()[:5] == ["your", "overrides", "4", "4", "128"]
    with pytest.raises(SystemExit):
        main(["--config-name", "no-such-config"])
    assert capsys.readouterr().err.startswith("error: --config-name: 'no-such-config' is no YAML beside")

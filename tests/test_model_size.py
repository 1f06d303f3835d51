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

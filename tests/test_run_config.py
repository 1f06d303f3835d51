"""run_config.py: the command line of main.py: Hydra's own refusals of it said in one line."""
import pytest
from helpers import one_error_line, run_main

from mingpt.common.errors import ConfigError
from mingpt.run_config import check_overrides, compose_config, hydra_line, load_config

TRACEBACK = '''Traceback (most recent call last):
  File "/venv/hydra/_internal/utils.py", line 220, in run_and_report
    return func()
  File "/venv/yaml/parser.py", line 483, in parse_flow_sequence_entry
    raise ParserError("while parsing a flow sequence", self.marks[-1],
yaml.parser.ParserError: while parsing a flow sequence
  in "/runs/typo.yaml", line 5, column 15
expected ',' or ']', but got '<stream end>'
  in "/runs/typo.yaml", line 6, column 1
'''
MERGING = '''Error merging override trainer_config.batch_size=abc
Value 'abc' of type 'str' could not be converted to Integer
    full_key: trainer_config.batch_size
    reference_type=TrainerConfig
    object_type=TrainerConfig

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
'''
MISSING = '''Cannot find primary config 'nosuch'. Check that it's in your config search path.

Config search path:
\tprovider=hydra, path=pkg://hydra.conf
\tprovider=main, path=file:///work/main/mingpt

Set the environment variable HYDRA_FULL_ERROR=1 for a complete stack trace.
'''


@pytest.mark.parametrize("said, line", [
    (TRACEBACK, "while parsing a flow sequence in \"/runs/typo.yaml\", line 5, column 15; expected ',' or ']', "
                "but got '<stream end>' in \"/runs/typo.yaml\", line 6, column 1"),
    (MERGING, "Error merging override trainer_config.batch_size=abc; Value 'abc' of type 'str' could not be "
              "converted to Integer"),
    (MISSING, "Cannot find primary config 'nosuch'. Check that it's in your config search path. (the configs "
              "beside main.py: gpt2_train_cfg, laptop)"),
], ids=["yaml-traceback", "wrong-type", "missing-config"])
def test_what_hydra_says_when_it_refuses_is_one_line(said, line):
    assert hydra_line(said) == line


@pytest.mark.slow
def test_a_typo_inside_a_yaml_file_is_one_line_exit_1(tmp_path):
    """Hydra printed a whole traceback of its YAML parser for it (and 7 or 8 lines for the others)."""
    (tmp_path / "typo.yaml").write_text("defaults:\n  - gpt2_train_cfg\n  - _self_\ntrainer_config:\n"
                                        "  batch_size: [1\n")
    result = run_main(["--config-dir", tmp_path, "--config-name", "typo"])
    assert one_error_line(result) == (
        f"error: while parsing a flow sequence in \"{tmp_path / 'typo.yaml'}\", line 5, column 15; expected ',' "
        f"or ']', but got '<stream end>' in \"{tmp_path / 'typo.yaml'}\", line 6, column 1")
    assert result.returncode == 1 and result.stdout == ""


@pytest.mark.parametrize("override, line", [
    ("trainer_config.fault_tolerant=true", "trainer_config.fault_tolerant: moved to fault_tolerance_config.enabled; "
                                           "set that instead"),
    ("trainer_config.ft_lighthouse=http://node1:29510", "trainer_config.ft_lighthouse: moved to "
                                                        "fault_tolerance_config.lighthouse; set that instead"),
    ("+trainer_config.ft_quorum_timeout_s=60", "trainer_config.ft_quorum_timeout_s: moved to "
                                               "fault_tolerance_config.quorum_timeout_s; set that instead"),
], ids=["fault_tolerant", "ft_lighthouse", "added"])
def test_the_fault_tolerance_keys_of_earlier_releases_are_refused_naming_the_new_ones(override, line):
    with pytest.raises(ConfigError) as refused:
        check_overrides([override])
    assert str(refused.value) == line


def test_a_yaml_with_a_moved_key_is_refused_too():
    """Hydra adds a key a YAML (or +key=...) brings; the typed config then refuses it by name."""
    cfg = compose_config(["+trainer_config.ft_replica_groups=2"])
    with pytest.raises(ConfigError, match="^trainer_config.ft_replica_groups: moved to "
                                          "fault_tolerance_config.replica_groups; set that instead$"):
        load_config(cfg)

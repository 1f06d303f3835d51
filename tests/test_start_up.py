"""start_up.py: a run's start-up, shared by main.py and plan.py --check, in one process: the data read
and split, the model on the meta device sized by the data, a truncated text of the user's said once,
and the Trainer with the lines it starts with. Whole runs through it: test_main.py; the check's ranks:
tests/test_cluster_check.py."""
import torch
from helpers import REPO, tiny_overrides

from mingpt.char_dataset import split_dataset
from mingpt.common.logger import configure_logging
from mingpt.run_config import from_command_line
from mingpt.start_up import load_dataset, start_trainer, train_objects


def config_of(text_file, tmp_path, **extra):
    return from_command_line(tiny_overrides(text_file, tmp_path / "snap.pt", **extra), "main.py")


def test_the_model_is_sized_by_the_data_on_the_meta_device_beside_the_seeded_splits(world_of_one, text_file,
                                                                                    tmp_path, capsys):
    configure_logging(rank=0)
    config = config_of(text_file, tmp_path, trainer_config__seed=7)
    model, dataset, train_set, test_set = train_objects(config, world_of_one)
    assert capsys.readouterr().out == f"Data has 6000 characters, {dataset.vocab_size} unique.\n"
    assert {p.device.type for p in model.parameters()} == {"meta"}  # the Trainer places it
    assert (model.config.vocab_size, model.config.block_size) == (dataset.vocab_size, 16)
    train, test = split_dataset(dataset, config.data_config, seed=7)
    every = torch.arange(len(train))
    assert len(train_set) == len(train) and torch.equal(train_set.starts(every), train.starts(every))
    assert len(test_set) == len(test)


def test_a_truncated_text_of_the_user_s_says_how_much_it_keeps_and_the_original_s_corpus_does_not(
        world_of_one, text_file, tmp_path, capsys):
    configure_logging(rank=0)
    load_dataset(config_of(text_file, tmp_path, data_config__truncate=0.5).data_config, world_of_one)
    said = capsys.readouterr().out.splitlines()
    warning = ("warning: data_config.truncate=0.5 keeps the first 3,000 of the text's 6,000 characters (the "
               "original's setting, made for tiny-shakespeare); data_config.truncate=1.0 trains on all of it")
    assert said == [warning, "Data has 3000 characters, " + said[1].split(", ")[1]]
    default = config_of(REPO / "data" / "input.txt", tmp_path, data_config__truncate=0.05).data_config
    load_dataset(default, world_of_one)
    assert capsys.readouterr().out == "Data has 55769 characters, 59 unique.\n"  # the original's line alone


def test_the_trainer_starts_with_its_summary_of_the_run(world_of_one, text_file, tmp_path, capsys):
    configure_logging(rank=0)
    config = config_of(text_file, tmp_path)
    trainer, summary = start_trainer(config, world_of_one, train_objects(config, world_of_one))
    kinds = ["Model", "Optimizer", "World", "Memory", "Batch", "Data", "Snapshots"]
    assert [line.split(":")[0] for line in summary] == kinds
    assert summary[0].startswith("Model: GPT") and "(random split)" in summary[5]
    assert {p.device.type for p in trainer.model.parameters()} == {"cpu"}  # placed: one rank holds it all

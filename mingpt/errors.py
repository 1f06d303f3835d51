"""Errors a user can fix: printed as one line (no traceback), exit status 1.

Anything else that goes wrong is a bug and keeps its traceback.
"""
import argparse


class MinGPTError(Exception):
    """A problem with the user's input: config, data, paths, credentials or snapshots."""


class ConfigError(MinGPTError):
    """A config value is out of range or inconsistent; the message names the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key


class DataError(MinGPTError):
    """The training text cannot be read or is unusable with the configured sizes."""


class SnapshotError(MinGPTError):
    """A snapshot cannot be read, or belongs to another model or vocabulary."""


def check(condition: bool, key: str, problem: str) -> None:
    """Raise ConfigError(key, problem) unless condition holds."""
    if not condition:
        raise ConfigError(key, problem)


def check_positive(config: object, prefix: str, *fields: str) -> None:
    """Each named field of config must be a positive number."""
    for name in fields:
        value = getattr(config, name)
        check(value > 0, f"{prefix}.{name}", f"must be positive, got {value}")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are MinGPTErrors: one line and exit 1, like every other error here."""

    def error(self, message: str) -> None:
        raise MinGPTError(f"{message} (see --help)")

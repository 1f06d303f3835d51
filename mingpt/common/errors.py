"""Errors a user can fix: printed as one line (no traceback), exit status 1.

Anything else that goes wrong is a bug and keeps its traceback. Every command the project has
(training, generate, prepare_data, ...) runs inside the one shell below, `command`.
"""
import argparse
import atexit
import contextlib
import functools
import gc
import os
import sys
from pathlib import Path
from typing import Callable, TypeVar

Result = TypeVar("Result")


class MinGPTError(Exception):
    """A problem with the user's input: config, data, paths, credentials or snapshots."""

    said: bool = False
    """Another process of the job has said it already (see distributed/process_group.py)."""
    origin: str = ""
    """Who says it, when that is not the only or first rank: "[rank 3] "."""


class ConfigError(MinGPTError):
    """A config value is out of range or inconsistent; the message names the key."""

    def __init__(self, key: str, problem: str):
        super().__init__(f"{key}: {problem}")
        self.key = key


class DataError(MinGPTError):
    """The training text cannot be read or is unusable with the configured sizes."""


class SnapshotError(MinGPTError):
    """A snapshot cannot be read, or belongs to another model or vocabulary."""


class StorageError(MinGPTError, OSError):
    """A file of the run (local, or behind a URL) cannot be read or written: a store gone away, a
    full disk, revoked credentials. Said as one line naming the file and the cause; an OSError too,
    so that code that handles a failed file still does."""

    def __init__(self, verb: str, url: str, cause: BaseException):
        self.reason = short_reason(cause)
        """The cause in one line, for a caller that says it in a line of its own (naming its key)."""
        super().__init__(f"could not {verb} {url} ({self.reason}); check the path, its credentials, free "
                         "space and the network")

    def __reduce__(self):
        # Pickled as its line: DCP hands each rank's failure to the others (a cause, a store's own
        # exception, may not unpickle, and __init__ wants it: the line said "TypeError: StorageError").
        return _storage_error, (str(self), self.reason)


def _storage_error(line: str, reason: str) -> StorageError:
    error = StorageError.__new__(StorageError)
    Exception.__init__(error, line)
    error.reason = reason
    return error


class TrainingDiverged(MinGPTError):
    """The loss or the weights are no longer finite: the run stops, its last snapshot untouched."""


def check(condition: bool, key: str, problem: str) -> None:
    """Raise ConfigError(key, problem) unless condition holds."""
    if not condition:
        raise ConfigError(key, problem)


class KeyGroup:
    """A group of a config section's keys, declared beside the code that reads them (TrainerConfig's
    bases). Each group checks its own keys in __post_init__, then calls super().__post_init__() for the
    next group's; this class ends the chain."""

    def __post_init__(self) -> None:
        pass


def check_positive(config: object, prefix: str, *fields: str) -> None:
    """Each named field of config must be a positive number."""
    for name in fields:
        value = getattr(config, name)
        check(value > 0, f"{prefix}.{name}", f"must be positive, got {value}")


def check_not_negative(config: object, prefix: str, *fields: str) -> None:
    """Each named field of config must be zero or more (zero: off)."""
    for name in fields:
        value = getattr(config, name)
        check(value >= 0, f"{prefix}.{name}", f"must not be negative, got {value}")


def check_choice(config: object, prefix: str, name: str, choices: tuple) -> None:
    """The named field of config must be one of choices."""
    value = getattr(config, name)
    check(value in choices, f"{prefix}.{name}", f"must be one of {', '.join(choices)}, got {value!r}")


class OneLineArgumentParser(argparse.ArgumentParser):
    """argparse whose mistakes are MinGPTErrors: one line and exit 1, like every other error here."""

    def error(self, message: str) -> None:
        raise MinGPTError(f"{message} (see --help)")


REASON_CHARACTERS = 160


def short_reason(error: BaseException) -> str:
    """`Type: first line` of an exception, for one-line messages; a long line ends at its last whole
    sentence that fits (or word, with "..."), never in the middle of a word."""
    if isinstance(error, StorageError):
        return error.reason  # the file's own cause, not "could not read ..." twice
    text = str(error).strip()
    line = text.splitlines()[0] if text else ""
    if len(line) > REASON_CHARACTERS:
        cut = line[:REASON_CHARACTERS + 1]
        sentence_end = cut.rfind(". ")
        line = cut[:sentence_end + 1] if sentence_end > 0 else cut.rsplit(" ", 1)[0] + "..."
    return f"{type(error).__name__}: {line}"


def say_error(error: MinGPTError, origin: str = "") -> None:
    """The one line a user sees: `error: [origin] what is wrong; what to do`."""
    say_line(f"error: {origin}{own_line(error)}")


def say_line(line: str) -> None:
    """A line on stderr in one write, its newline included. print writes the text, then the newline:
    unbuffered (PYTHONUNBUFFERED, usual under Slurm and in the tests) those are two writes, and two
    ranks saying a line at once interleave them ("...beforeerror: [rank 0] ..."). One write of a line
    (under the pipe's 4 KiB) is never split by another process's."""
    sys.stderr.write(f"{line}\n")
    sys.stderr.flush()


def own_line(error: MinGPTError) -> str:
    """What the error says. torch's DataLoader raises an error of one of its worker processes again
    in the training process, of the same kind but with a message of its own ("Caught DataError in
    DataLoader worker process 0.", then the worker's traceback): the error's own line is its last,
    after "mingpt.common.errors.DataError: "."""
    text = str(error)
    if text.startswith("Caught ") and "\nOriginal Traceback" in text:
        return text.rstrip().splitlines()[-1].split(": ", 1)[-1]
    return text


USER_ERROR_RECORD_ENV = "MINGPT_USER_ERRORS"
"""A folder where a process that ends on a user's error leaves a file rank<N> (launch.py sets it): its
launcher does not start it again, since it would say the same."""


def record_user_error(line: str) -> None:
    folder = os.environ.get(USER_ERROR_RECORD_ENV)
    if folder:
        with contextlib.suppress(OSError):
            (Path(folder) / f"rank{os.environ.get('RANK', '0')}").write_text(line)


def command(body: Callable[..., Result]) -> Callable[..., Result]:
    """The shell of every command: a MinGPTError is said in one line on stderr and exits with status
    1; anything else keeps its traceback. Called in a test, a command returns what body returns."""
    @functools.wraps(body)
    def run(*args, **kwargs) -> Result:
        freeze_objects_at_exit()
        try:
            result = body(*args, **kwargs)
            sys.stdout.flush()  # here, so that a reader gone away is seen below, not at exit
            return result
        except MinGPTError as error:
            if not error.said:
                say_error(error, error.origin)
            record_user_error(own_line(error))
            sys.exit(1)
        except BrokenPipeError:  # the reader went away (`| head`): no traceback, nothing more to say
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # what is buffered goes nowhere
            sys.exit(1)
    return run


@functools.cache
def freeze_objects_at_exit() -> None:
    """At exit, Python's finalisation collects garbage over every object the process still holds:
    with torch imported, about 0.7 s of every process's end (every rank, every restart, every
    command). Frozen first, those objects are not scanned; the system takes the memory back with
    the process. Registered once, when a command starts, not when the package is imported (a
    program that merely imports it keeps its own exit)."""
    atexit.register(gc.freeze)

"""The project's one logger. Global rank 0 speaks; other ranks report only warnings and errors.

Lines are printed bare (no level or timestamp) so the original's log lines read exactly as before.
On a terminal, rank 0 can also keep a status line (the progress bar) that log lines scroll above.
"""
import logging
import sys

log = logging.getLogger("mingpt")
_rank = 0
_CLEAR_LINE = "\r\033[K"


class _Formatter(logging.Formatter):
    """Bare messages; warnings and errors say what they are and, off rank 0, which rank."""

    def __init__(self, rank: int):
        super().__init__("%(message)s")
        self.origin = "" if rank == 0 else f"[rank {rank}] "

    def format(self, record: logging.LogRecord) -> str:
        message = super().format(record)
        if record.levelno >= logging.WARNING:
            return f"{self.origin}{record.levelname.lower()}: {message}"
        return message


class _Console(logging.StreamHandler):
    """stdout, with an optional status line kept below the log lines on a terminal. The stdout of the
    moment of each line, not of the handler's making: one replaced since (a test's capture, closed
    when that test ended; a redirection) would otherwise get the line, or fail with a traceback."""

    def __init__(self):
        super().__init__()
        self.status = ""

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, value) -> None:
        pass  # always sys.stdout as it is now

    def emit(self, record: logging.LogRecord) -> None:
        if self.status:
            self.stream.write(_CLEAR_LINE)
        super().emit(record)
        if self.status:
            self.stream.write(self.status)
            self.flush()

    def set_status(self, text: str) -> None:
        self.status = text
        self.stream.write(_CLEAR_LINE + text)
        self.flush()


_console = _Console()


def configure_logging(rank: int) -> None:
    """Route the project's logger to stdout, at INFO on rank 0 and WARNING elsewhere."""
    global _rank, _console
    _rank = rank
    _console = _Console()
    _console.setFormatter(_Formatter(rank))
    log.handlers.clear()
    log.addHandler(_console)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False


def on_terminal() -> bool:
    return sys.stdout.isatty()


def show_status(text: str) -> None:
    """Rank 0's progress: a self-updating line on a terminal, an ordinary log line elsewhere."""
    if _rank != 0:
        return
    if on_terminal():
        _console.set_status(text)
    else:
        log.info(text)


def clear_status() -> None:
    if _rank == 0 and _console.status:
        _console.set_status("")


def warn_once(message: str) -> None:
    """A warning that concerns every rank alike: printed by global rank 0 only."""
    if _rank == 0:
        log.warning(message)

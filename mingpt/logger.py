"""The project's one logger. Global rank 0 speaks; other ranks report only warnings and errors.

Lines are printed bare (no level or timestamp) so the original's log lines read exactly as before.
"""
import logging
import sys

log = logging.getLogger("mingpt")
_rank = 0


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


def configure_logging(rank: int) -> None:
    """Route the project's logger to stdout, at INFO on rank 0 and WARNING elsewhere."""
    log.handlers.clear()
    handler = logging.StreamHandler(sys.stdout)
    handler.setFormatter(_Formatter(rank))
    log.addHandler(handler)
    log.setLevel(logging.INFO if rank == 0 else logging.WARNING)
    log.propagate = False
    global _rank
    _rank = rank


def warn_once(message: str) -> None:
    """A warning that concerns every rank alike: printed by global rank 0 only."""
    if _rank == 0:
        log.warning(message)

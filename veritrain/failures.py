"""What a failed command says: one line, what failed and what to do.

``veritrain`` ends every failure with :func:`failure_line` on stderr and a non-zero
exit code; the traceback only with ``-v``. A ``SystemExit`` with a message (how
the commands refuse a bad argument or state) is said as it is; the errors a user
can provoke (an unreachable ledger, a refusal, a file that cannot be read) are
explained here; anything else is named by its type, with a pointer to ``-v``.
"""

from __future__ import annotations

__all__ = ["failure_line", "one_line"]

#: What to do after a refusal, by the ledger's stable reason.
REFUSAL_HINTS = {
    "not_found": "`veritrain audit report` lists the run's rounds and workers",
    "bad_signature": "is this the right key file for this run?",
    "unknown_worker": "register the worker first (`veritrain worker` does at start)",
    "unknown_validator": "is the key one of the run's validators?",
    "banned": "this key is banned for the rounds the ledger says",
    "not_admitted": "the run admits only keys its organiser ticketed (`veritrain admit`) or "
                    "bonded (`veritrain bond deposit`)",
}


def one_line(text: str) -> str:
    """``text`` with every run of whitespace (newlines included) made one space."""
    return " ".join(str(text).split())


def failure_line(exc: BaseException) -> str:
    """What failed and what to do, as one line."""
    from veritrain.ledger.client import LedgerRefused, LedgerUnavailable
    from veritrain.protocol.errors import RejectedInput

    if isinstance(exc, SystemExit):
        return one_line(str(exc.code))
    if isinstance(exc, LedgerUnavailable):
        if exc.cause.startswith("it answered HTTP"):
            return one_line(f"the ledger at {exc.url} kept failing for {exc.seconds:.0f}s "
                            f"({exc.what}: {exc.cause}); its log says why")
        return one_line(f"cannot reach the ledger at {exc.url} ({exc.cause}, for "
                        f"{exc.seconds:.0f}s): is `veritrain ledger serve` running there? "
                        "Check --ledger")
    if isinstance(exc, LedgerRefused):
        hint = REFUSAL_HINTS.get(exc.reason)
        return one_line(f"the ledger refused {exc.what or 'the request'}: {exc.detail} "
                        f"({exc.reason}){'; ' + hint if hint else ''}")
    if isinstance(exc, RejectedInput):
        return one_line(f"{exc} ({exc.reason})")
    if isinstance(exc, OSError):
        return one_line(_os_error(exc))
    return one_line(f"unexpected {type(exc).__name__}: {exc} (run `veritrain -v ...` for the "
                    "traceback)")


def _os_error(exc: OSError) -> str:
    if exc.filename is not None and exc.strerror:
        return f"{exc.filename}: {exc.strerror}"
    return str(exc) or type(exc).__name__

"""The real error of a failed run, from Flower's log of it.

Flower reports a run whose simulation runtime failed (Ray could not start,
a ClientApp actor died) as ``finished:failed`` with the details
"Simulation failed with exception: An error was encountered. Ending
simulation.", and a ServerApp exception with its message but not its type.
The traceback is only in the run's log (``flwr log <run-id> <connection>
--show``), which the SuperLink keeps only while it runs. :func:`real_error`
picks the line that says what went wrong; the CLI saves the whole log next
to the run (``flower.log``) before it stops the SuperLink.
"""

from __future__ import annotations

import re

__all__ = ["GENERIC_ERRORS", "real_error"]

#: Flower's wrappers around the real exception: never the error reported
#: when the log holds anything else
GENERIC_ERRORS = (
    "An error was encountered. Ending simulation.",
    "Simulation failed with exception",
    "Task failed with unknown error",
)
#: lines Flower logs at level ERROR that say nothing about the cause
_BOILERPLATE = (
    "Exit Code:",
    "raised an exception",
    "An exception occurred !!",
    "An unhandled exception occurred",
    "For more information, visit",
)
_ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
#: Ray's prefix of an actor's output, e.g. ``(ClientAppActor pid=123) ``
_ACTOR = re.compile(r"^\(\w+ pid=\d+(?:, ip=[^)]*)?\)\s?")
#: a logged record at level ERROR (Flower: ``ERROR :     message``)
_ERROR_RECORD = re.compile(r"^ERROR\s*:\s*(.*)$")
#: a logged record at a level that is no error
_OTHER_RECORD = re.compile(r"^(DEBUG|INFO|WARNING)\s*:")
#: fedadapt's one-line user errors (``fedadapt.server.run.OneLineUserErrors``)
_USER_ERROR = "fedadapt: run failed: "
_TRACEBACK = "Traceback (most recent call last):"


def _clean(text: str) -> list[str]:
    """Return the log's lines without colours and Ray's actor prefixes."""
    return [_ACTOR.sub("", _ANSI.sub("", line)).rstrip() for line in text.splitlines()]


def _exception_line(lines: list[str], start: int) -> tuple[int, str] | None:
    """Return the ``Type: message`` line ending the traceback that starts at ``start``.

    Frames and the source lines under them are indented; the first line
    after the header that is not is the exception (Python's last line of a
    traceback, the first of a message that spans several).
    """
    for index in range(start + 1, len(lines)):
        line = lines[index]
        if line and not line[0].isspace():
            return (index, line) if line != _TRACEBACK else None
    return None


def _generic(line: str) -> bool:
    return any(text in line for text in GENERIC_ERRORS)


def real_error(log: str) -> str:
    """Return the line of Flower's ``log`` that says why the run failed.

    The last traceback's last line (``IsADirectoryError: [Errno 21] …``),
    skipping Flower's own wrappers (:data:`GENERIC_ERRORS`), so that of a
    chain of exceptions the cause is reported, not "An error was
    encountered. Ending simulation."; a later fedadapt one-line error
    (``fedadapt: run failed: …``, logged without a traceback) wins over
    earlier tracebacks (e.g. the ClientApps' that it sums up). Without a
    traceback: the last line logged at level ERROR that is not Flower's
    boilerplate, else the last line that names an error. "" if none.
    """
    lines = _clean(log)
    found: list[tuple[int, str]] = []
    for index, line in enumerate(lines):
        if line.endswith(_TRACEBACK):
            ending = _exception_line(lines, index)
            if ending is not None and not _generic(ending[1]):
                found.append(ending)
        elif _USER_ERROR in line:
            found.append((index, line[line.index(_USER_ERROR) :]))
    if found:
        return max(found)[1].strip()
    records = [
        match.group(1).strip()
        for line in lines
        if (match := _ERROR_RECORD.match(line)) and match.group(1).strip()
    ]
    useful = [r for r in records if not any(b in r for b in _BOILERPLATE)]
    if useful:
        return useful[-1]
    named = [
        line.strip()
        for line in lines
        if re.search(r"\b\w*(Error|Exception)\b", line)
        and not _generic(line)
        and not _OTHER_RECORD.match(line)
    ]
    return named[-1] if named else ""

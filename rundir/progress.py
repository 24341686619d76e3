"""Progress of a long command on stderr, so that stdout and ``--out`` files stay clean.

On a terminal it is tqdm's bar. Anywhere else (a SLURM log, a pipe, a test) a
bar redrawn with carriage returns is noise, so one plain line is written each
time another ``every`` percent is done (and at the end), with tqdm's own
counts, rate and ETA. Torch-free, like the rest of ``rundir``: every layer can
use it.

    for item in progress(items, desc="hellaswag", unit="item"):
        ...
    with progress(total=n_bytes, desc="write", unit="B") as bar:
        bar.update(len(chunk))
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterable, Iterator
from typing import IO

from tqdm import tqdm


class LogLines:
    """tqdm's counting and formatting, printed as a line per ``every`` percent instead of a bar."""

    def __init__(self, iterable: Iterable | None, total: float | None, desc: str, unit: str,
                 every: float, file: IO[str], unit_scale: bool):
        self.iterable, self.total, self.desc, self.unit = iterable, total, desc, unit
        self.every, self.file, self.unit_scale = every, file, unit_scale
        self.n, self.start, self._shown = 0, time.monotonic(), 0.0

    def __iter__(self) -> Iterator:
        for item in self.iterable:
            yield item
            self.update()
        self.close()

    def __enter__(self) -> LogLines:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def update(self, n: float = 1) -> None:
        self.n += n
        if self.total and 100 * self.n / self.total >= self._shown + self.every:
            self._write()

    def close(self) -> None:
        if self.n and (not self.total or self._shown < 100):
            self._write()

    def _write(self) -> None:
        self._shown = 100 * self.n / self.total if self.total else 100
        line = tqdm.format_meter(self.n, self.total, time.monotonic() - self.start, ncols=0, prefix=self.desc,
                                 unit=self.unit, unit_scale=self.unit_scale)
        print(line, file=self.file, flush=True)


def progress(iterable: Iterable | None = None, *, total: float | None = None, desc: str = "",
             unit: str = "it", every: float = 5.0, disable: bool = False, unit_scale: bool = False,
             file: IO[str] | None = None) -> tqdm | LogLines:
    """A tqdm bar on a terminal, else a ``LogLines``; both count with ``update(n)`` or by iteration.
    ``disable``: nothing is shown (e.g. on ranks other than 0)."""
    file = file or sys.stderr
    if total is None and iterable is not None and hasattr(iterable, "__len__"):
        total = len(iterable)
    if disable or file.isatty():
        return tqdm(iterable, total=total, desc=desc, unit=unit, file=file, disable=disable,
                    unit_scale=unit_scale, dynamic_ncols=True)
    return LogLines(iterable, total, desc, unit, every, file, unit_scale)

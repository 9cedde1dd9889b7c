"""Progress for the command's long passes: a tqdm bar on a terminal, plain periodic lines
when stderr is a file or a pipe (logs of batch jobs), nothing with ``--quiet``."""

from __future__ import annotations

import os
import sys
import time
from typing import Any, TextIO

__all__ = ["Progress", "human_bytes", "log"]

# Seconds between plain progress lines; a job log gets a line every half minute, tests
# set it to 0 to see every update.
_INTERVAL_ENV = "FASTPACK_PROGRESS_INTERVAL"


def human_bytes(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def log(message: str, *, quiet: bool = False, stream: TextIO | None = None) -> None:
    """One line on stderr, prefixed so it stands out in a job log."""
    if not quiet:
        print(f"fastpack: {message}", file=stream or sys.stderr, flush=True)


class Progress:
    """Counts work done out of ``total`` (None: unknown) and shows it.

    ``unit="B"`` shows bytes (the reading passes count bytes of the input files, the one
    measure every format shares)."""

    def __init__(
        self,
        desc: str,
        total: int | None,
        *,
        unit: str = "rows",
        quiet: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        self.desc, self.total, self.unit = desc, total, unit
        self.n = 0
        self.stream = stream or sys.stderr
        self.quiet = quiet
        self._start = time.monotonic()
        self._last = self._start
        self._interval = float(os.environ.get(_INTERVAL_ENV, "30"))
        self._bar: Any = None
        self._postfix = ""
        if not quiet and self.stream.isatty():
            from tqdm.auto import tqdm

            self._bar = tqdm(
                total=total, desc=f"fastpack: {desc}", unit=unit if unit != "B" else "B",
                unit_scale=True, unit_divisor=1000, file=self.stream, dynamic_ncols=True,
                mininterval=0.25,
            )

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close(done=exc[0] is None)

    def _amount(self, n: float) -> str:
        return human_bytes(n) if self.unit == "B" else f"{int(n):,} {self.unit}"

    def set_postfix(self, text: str) -> None:
        self._postfix = text
        if self._bar is not None:
            self._bar.set_postfix_str(text, refresh=False)

    def update(self, n: int) -> None:
        self.n += n
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.update(n)
            return
        now = time.monotonic()
        if now - self._last >= self._interval:
            self._last = now
            share = f" ({self.n / self.total:.0%})" if self.total else ""
            total = f"/{self._amount(self.total)}" if self.total else ""
            post = f"; {self._postfix}" if self._postfix else ""
            log(f"{self.desc}: {self._amount(self.n)}{total}{share}, "
                f"{now - self._start:.0f} s{post}", stream=self.stream)

    def close(self, *, done: bool = True) -> None:
        if self.quiet:
            return
        if self._bar is not None:
            self._bar.close()
            self._bar = None
            return
        if done:
            post = f"; {self._postfix}" if self._postfix else ""
            log(f"{self.desc}: done, {self._amount(self.n)} in "
                f"{time.monotonic() - self._start:.1f} s{post}", stream=self.stream)
            self.quiet = True  # close once

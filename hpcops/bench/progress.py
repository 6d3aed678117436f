"""A dependency-free progress bar on stderr (one line, redrawn; plain lines when not a terminal)."""

from __future__ import annotations

import sys
import time


class Progress:
    def __init__(self, total: int | None, label: str, *, stream=sys.stderr, enabled: bool = True):
        self.total, self.label, self.stream, self.enabled = total, label, stream, enabled
        self.done, self.start = 0, time.monotonic()
        self.tty = getattr(stream, "isatty", lambda: False)()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        if self.total:
            width = 24
            fill = int(width * self.done / self.total)
            bar = "#" * fill + "." * (width - fill)
            eta = elapsed / self.done * (self.total - self.done)
            line = f"{self.label} [{bar}] {self.done}/{self.total} {elapsed:5.0f}s eta {eta:4.0f}s  {what}"
        else:
            line = f"{self.label} {self.done} {elapsed:5.0f}s  {what}"
        if self.tty:
            self.stream.write("\r\033[K" + line[:150])
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def close(self) -> None:
        if self.enabled and self.tty:
            self.stream.write("\n")
            self.stream.flush()

"""A dependency-free progress line: ``step/total [bar] loss acc tok/s eta`` on stderr."""

import sys
import time


class Progress:
    """Redraws one line on a terminal; elsewhere prints a line every `every` updates and the last one."""

    def __init__(self, total, label="", every=None, stream=None, width=24):
        self.total, self.label, self.width = total, label, width
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.every = every or max(1, total // 10)
        self.start = time.perf_counter()

    def update(self, step, **metrics):
        if not self.tty and step % self.every and step != self.total:
            return
        elapsed = time.perf_counter() - self.start
        filled = int(self.width * step / self.total)
        eta = elapsed / max(step, 1) * (self.total - step)
        parts = " ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in metrics.items())
        line = f"{self.label} {step}/{self.total} [{'#' * filled}{'.' * (self.width - filled)}] {parts} eta {eta:.0f}s"
        self.stream.write(("\r" + line) if self.tty else (line + "\n"))
        if self.tty and step == self.total:
            self.stream.write("\n")
        self.stream.flush()

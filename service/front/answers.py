"""The answers nginx gives itself (no ingress reachable, a body over the limit, HTTP it cannot take),
counted for /metrics: they never reach the ingress, whose middleware counts every other request.

nginx writes one line per such answer to its stdout (config.py: `ANSWER_TAG <status> <path>`); the
front reads them (`Answers.read`), counts them by path and status, and writes the totals into the
node's metrics directory (`Answers.write`; service/telemetry/front_answers.py has the file and the
/metrics side). Totals only grow, across nginx restarts. At most MAX_PATHS distinct paths are kept
(a client can send any number): later ones count under the path "", which /metrics reports as the
endpoint "other" like any path the API does not have. The statuses nginx can answer (config.py's
ANSWERED, passed in) are counted at 0 under that path from the start, so /metrics shows each as
soon as the front runs, before it first answers.
"""

from __future__ import annotations

import logging
import threading
from collections import Counter
from collections.abc import Iterable
from pathlib import Path

from ..telemetry.front_answers import write_totals

ANSWER_TAG = "ts-answer"
log = logging.getLogger(__name__)
MAX_PATHS = 64


class Answers:
    """Counts of nginx's own answers by (path, status), written to `file` (None: kept here only);
    `statuses` start at 0 under the path "". Thread-safe."""

    def __init__(self, file: Path | None = None, statuses: Iterable[int] = ()) -> None:
        self.file = file
        self._lock = threading.Lock()
        self._counts: Counter[tuple[str, int]] = Counter({("", status): 0 for status in statuses})
        self._paths: set[str] = set()  # the paths counted under their own name (at most MAX_PATHS)
        self._written: dict[tuple[str, int], int] = {}
        self._warned = False

    def add(self, path: str, status: int) -> None:
        with self._lock:
            if path not in self._paths:
                if len(self._paths) >= MAX_PATHS:
                    path = ""
                else:
                    self._paths.add(path)
            self._counts[(path, status)] += 1

    def read(self, lines: Iterable[bytes]) -> None:
        """Count every answer line of nginx's stdout until it closes; other lines are ignored."""
        for raw in lines:
            tag, _, rest = raw.decode(errors="replace").rstrip("\n").partition(" ")
            status, _, path = rest.partition(" ")
            if tag == ANSWER_TAG and status.isdigit():
                self.add(path, int(status))

    def totals(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._counts)

    def write(self) -> None:
        """The totals into `file` when they changed since the last write. A file that cannot be
        written costs the metric, never the front: logged once, tried again at the next change."""
        totals = self.totals()
        if self.file is None or totals == self._written:
            return
        try:
            write_totals(self.file, totals)
        except OSError as e:
            if not self._warned:
                log.warning("front: could not write its answers' counts to %s: %s", self.file, e)
                self._warned = True
            return
        self._written = totals

"""The nginx front's own answers (service/front/answers.py counts them) shared with /metrics through
one JSON file per front in the node's metrics directory: `write_totals` there, `FrontAnswersCollector`
here, in the ingress's /metrics (service/telemetry/metrics.py: `render`), as
`transformer_serve_front_answers_total{endpoint, status}`. Paths the API does not have are the
endpoint "other", as for the ingress's own requests. A file is replaced whole (written aside, then
renamed), so a reader sees old totals or new ones, never half a file."""

from __future__ import annotations

import json
from collections.abc import Callable, Collection, Iterator, Mapping
from pathlib import Path

from prometheus_client.core import CounterMetricFamily
from prometheus_client.metrics_core import Metric

from .endpoints import endpoint_label

FILE_GLOB = "front-*.json"


def answers_file(node_dir: Path, pid: int) -> Path:
    """Where the front run by process `pid` keeps its totals, in its node's metrics directory."""
    return node_dir / f"front-{pid}.json"


def write_totals(file: Path, totals: Mapping[tuple[str, int], int]) -> None:
    """{(path, status): count} into `file`, atomically."""
    file.parent.mkdir(parents=True, exist_ok=True)
    part = file.with_name(f".{file.name}.part")
    part.write_text(json.dumps({"answers": [[path, status, n] for (path, status), n in sorted(totals.items())]}))
    part.replace(file)


def load_totals(file: Path) -> dict[tuple[str, int], int]:
    """`write_totals`' file -> {(path, status): count}; {} when it is gone or unreadable."""
    try:
        rows = json.loads(file.read_text())["answers"]
        return {(str(path), int(status)): int(n) for path, status, n in rows}
    except (OSError, ValueError, KeyError, TypeError):
        return {}


class FrontAnswersCollector:
    """A prometheus_client collector of the counter `name` (prometheus_client's family name, without
    _total): every front file of `node_dir`, paths mapped to endpoints (`endpoints()`: the API's
    paths; any other path is "other"). A front writes its file when it starts, with each status it
    can answer at 0 under the endpoint "other" (service/front/answers.py), so a node with a front
    exports those from the first scrape; a node without one (no file) exports nothing: no front
    answers there, and no series says otherwise."""

    def __init__(self, node_dir: Path, name: str, help_text: str, endpoints: Callable[[], Collection[str]]) -> None:
        self.node_dir, self.name, self.help_text, self.endpoints = node_dir, name, help_text, endpoints

    def collect(self) -> Iterator[Metric]:
        known = self.endpoints()
        counts: dict[tuple[str, str], int] = {}
        for file in sorted(self.node_dir.glob(FILE_GLOB)):
            for (path, status), n in load_totals(file).items():
                key = (endpoint_label(path, known), str(status))
                counts[key] = counts.get(key, 0) + n
        if not counts:
            return
        family = CounterMetricFamily(self.name, self.help_text, labels=("endpoint", "status"))
        for (endpoint, status), n in sorted(counts.items()):
            family.add_metric([endpoint, status], n)
        yield family

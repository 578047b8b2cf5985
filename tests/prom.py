"""Reading Prometheus text exposition in tests, with prometheus_client's own parser."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families


class Samples:
    """One scrape: every sample by (name, labels), every family's type by its name."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.types: dict[str, str] = {}
        self._values: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        for family in text_string_to_metric_families(text):
            self.types[family.name] = family.type
            for sample in family.samples:
                self._values[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value

    def value(self, name: str, **labels: str) -> float:
        """The sample ``name{labels}``; KeyError (naming what there is) when the scrape has none."""
        key = (name, tuple(sorted(labels.items())))
        if key not in self._values:
            near = sorted({f"{n}{dict(ls)}" for n, ls in self._values if n.startswith(name)})
            raise KeyError(f"no sample {name}{labels} in the scrape; samples named like it: {near}")
        return self._values[key]

    def has(self, name: str, **labels: str) -> bool:
        return (name, tuple(sorted(labels.items()))) in self._values

    def labelled(self, name: str) -> dict[tuple[tuple[str, str], ...], float]:
        """Every sample called ``name``, by its labels."""
        return {ls: v for (n, ls), v in self._values.items() if n == name}

    def count(self, histogram: str, **labels: str) -> float:
        return self.value(f"{histogram}_count", **labels)

    def sum(self, histogram: str, **labels: str) -> float:
        return self.value(f"{histogram}_sum", **labels)


def scrape(host: str, port: int, timeout: float = 10.0) -> Samples:
    """GET http://host:port/metrics."""
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=timeout) as response:
        assert response.status == 200
        return Samples(response.read().decode())

"""Reading Prometheus text exposition in tests, with prometheus_client's own parser."""

from __future__ import annotations

import socket
import time
import urllib.request
from collections.abc import Callable

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


def scrape_until(host: str, port: int, done: Callable[[Samples], bool], timeout: float = 15.0) -> Samples:
    """Scrape until ``done(samples)`` holds (a call's last bookkeeping may land just after its client
    got the last message) and return that scrape; the last one if it never does, so the caller's
    asserts say what is off."""
    deadline = time.monotonic() + timeout
    while True:
        samples = scrape(host, port)
        try:
            if done(samples):
                return samples
        except KeyError:  # a series that is not there yet
            pass
        if time.monotonic() > deadline:
            return samples
        time.sleep(0.1)


def free_ports(count: int, host: str = "127.0.0.1") -> list[int]:
    """``count`` consecutive ports free on ``host`` right now (a TP worker's rank r serves metrics on
    its --metrics-port + r, serve's children on consecutive ports)."""
    for _ in range(200):
        with socket.socket() as probe:
            probe.bind((host, 0))
            base = probe.getsockname()[1]
        if base + count > 65535:
            continue
        sockets = []
        try:
            for port in range(base, base + count):
                sock = socket.socket()
                sockets.append(sock)
                sock.bind((host, port))
            return list(range(base, base + count))
        except OSError:
            continue
        finally:
            for sock in sockets:
                sock.close()
    raise RuntimeError(f"no {count} consecutive free ports on {host}")

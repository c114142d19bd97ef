"""``kiln_model_ready``: 1 per ready model version, 0 otherwise (kiln's own family).

Triton exports no readiness metric; without one a "model not ready" alert could only be
written against the HTTP health endpoint. A model whose load failed has no version yet
and is exposed with ``version=""``; a model the user explicitly unloaded is not exposed
(it is meant to be down). Read at collect time from in-memory state only.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from kiln.metrics import names
from kiln.metrics.exposition import counter
from kiln.repository.manager import ModelState, RepositoryManager
from kiln.repository.source import LocalSource


class ReadinessCollector(Collector):
    def __init__(self, repository: RepositoryManager[Any]) -> None:
        self.repository = repository

    def collect(self) -> Iterator[Metric]:
        family = GaugeMetricFamily(
            names.KILN_MODEL_READY,
            "1 when this model version is ready to serve inferences, else 0",
            labels=("model", "version"),
        )
        # list() copies: the collector also runs on history/alert threads while the
        # event loop may be loading a model.
        for entry in list(self.repository.entries.values()):
            versions = list(entry.versions.values())
            if versions:
                for rt in versions:
                    family.add_metric([rt.name, rt.version_str], int(rt.ready))
            elif entry.state is ModelState.UNAVAILABLE and entry.reason != "unloaded":
                family.add_metric([entry.name, ""], 0)
        yield family
        yield from self._remote()

    def _remote(self) -> Iterator[Metric]:
        """Per bucket: failed reads (a poll or a load that could not list or fetch) and
        objects fetched into the local cache (an unchanged object is fetched once)."""
        remote = [s for s in self.repository.sources if not isinstance(s, LocalSource)]
        if not remote:
            return
        errors = counter(
            "kiln_repository_errors_total",
            "Failed reads of a remote model repository (listings and fetches)",
        )
        downloads = counter(
            "kiln_repository_downloads_total",
            "Objects fetched from a remote model repository into the local cache",
        )
        for source in remote:
            labels = {"repository": source.url}
            errors.add_sample(errors.name, labels, source.errors)
            downloads.add_sample(downloads.name, labels, source.downloads)
        yield errors
        yield downloads

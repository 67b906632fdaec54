"""/metrics through the front (gateway.model_front): one Prometheus text for every model.

First the front's own gauges, one series per served model (its state, the bytes it holds against
the budget, its running requests), then each loaded model's gateway's own series, scraped when
/metrics is asked for, each sample labelled `model="NAME"`. Families of the same name are merged
(one HELP and TYPE, then every model's samples): the text format allows a family only once, so
the models' texts cannot simply be concatenated. A model not loaded, or whose scrape fails, shows
only in the front's gauges (reame_model_metrics_up says which scrapes answered).
"""
from __future__ import annotations

from typing import Iterable

from prometheus_client import generate_latest
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families

from gateway.model_residency import LOADED, LOADING, UNLOADED

MODEL_LABEL = "model"


def front_families(listing: list[dict], budget: int, scraped: dict[str, bool]) -> list[Metric]:
    """The front's gauges from ModelLoader.listing(); `scraped`: loaded model → its scrape answered."""
    state = GaugeMetricFamily("reame_model_state", "1 for the state each served model is in",
                              labels=[MODEL_LABEL, "state"])
    held = GaugeMetricFamily("reame_model_bytes", "Bytes a model holds against the budget: weights (its file) "
                             "plus its worker's KV pool; 0 while unloaded", labels=[MODEL_LABEL])
    running = GaugeMetricFamily("reame_model_running_requests", "Requests the front has running on a model",
                                labels=[MODEL_LABEL])
    up = GaugeMetricFamily("reame_model_metrics_up", "1 when a loaded model's gateway answered this scrape",
                           labels=[MODEL_LABEL])
    for model in listing:
        for name in (UNLOADED, LOADING, LOADED):
            state.add_metric([model["id"], name], float(model["state"] == name))
        held.add_metric([model["id"]], model["size"])
        running.add_metric([model["id"]], model["running"])
    for name, answered in scraped.items():
        up.add_metric([name], float(answered))
    total = GaugeMetricFamily("reame_models_budget_bytes", "[models] memory_budget in bytes", value=budget)
    return [state, held, running, up, total]


def labelled(texts: dict[str, str]) -> list[Metric]:
    """Each model's /metrics text (model name → text) as families whose samples carry the model."""
    families: dict[str, Metric] = {}
    for model, text in texts.items():
        for family in text_string_to_metric_families(text):
            merged = families.get(family.name)
            if merged is None:
                merged = families[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
            merged.samples += [s._replace(labels={**s.labels, MODEL_LABEL: model}) for s in family.samples]
    return list(families.values())


class _Families:
    def __init__(self, families: Iterable[Metric]):
        self.families = list(families)

    def collect(self) -> list[Metric]:
        return self.families


def render(families: Iterable[Metric]) -> bytes:
    return generate_latest(_Families(families))  # type: ignore[arg-type]: it only calls collect()

"""Serving: one record per (kernel family, device) -- what was decided, what serves, the layers verified
on it -- (:mod:`.records`), the layer checks (:mod:`.layers`), verifying and replacing (:mod:`.replace`),
SELECT=fastest per batch-size range (:mod:`.fastest`), the re-checks and the canary's reads (:mod:`.updates`)."""

from .fastest import retime
from .records import (
    LayerCheck,
    clear,
    decide,
    decisions,
    record_refusal,
    refusals,
    report_sections,
    route,
    route_table,
    routes,
)
from .replace import verify_layer
from .updates import (
    Served,
    check_served,
    fingerprint_problem,
    fingerprint_sweep,
    on_hang,
    recheck,
    reverify,
    served_configurations,
    served_layer,
    weights_update_begin,
    weights_update_end,
    weights_update_open_s,
    weights_updating,
)

__all__ = [
    "LayerCheck",
    "verify_layer",
    "recheck",
    "retime",
    "reverify",
    "weights_updating",
    "weights_update_begin",
    "weights_update_end",
    "weights_update_open_s",
    "refusals",
    "record_refusal",
    "decide",
    "decisions",
    "clear",
    "route",
    "route_table",
    "routes",
    "Served",
    "served_configurations",
    "served_layer",
    "check_served",
    "fingerprint_problem",
    "fingerprint_sweep",
    "report_sections",
    "on_hang",
]

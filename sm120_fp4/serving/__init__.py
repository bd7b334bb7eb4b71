"""Serving: one record per (kernel family, device) -- what was decided for it, what serves it, the
layers verified on it -- and everything done with the layers.

* :mod:`.records`: the records and the route table the hot path reads; :func:`decide`, :func:`route`.
* :mod:`.layers`: a layer's check through the call that will serve it, its fingerprint, its record.
* :mod:`.replace`: :func:`verify_layer`, and the replacement of a backend that fails a layer (the
  next candidate that passes everything so far, FALLBACK=emulated, SELFTEST=warn, or a refusal);
  SELECT=fastest settled on the served calls.
* :mod:`.updates`: :func:`recheck` after warm-up, :func:`reverify` after SGLang's weight updates,
  and what the serving canary reads (:func:`served_configurations`, :func:`check_served`).
"""

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

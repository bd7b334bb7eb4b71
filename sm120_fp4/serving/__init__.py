"""Serving: this process's state in one owner (.state: ``STATE``, which uninstall() resets), records (.records),
layer checks (.layers), replacing (.replace), SELECT=fastest (.fastest, shared by the ranks through .collective),
re-checks (.updates)."""

from .collective import use_group
from .fastest import retime
from .records import (
    LayerCheck,
    Unverified,
    decide,
    decisions,
    record_refusal,
    record_unverified,
    refusals,
    report_sections,
    route,
    route_table,
    routes,
    unverified,
)
from .replace import verify_layer
from .state import STATE, State
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
    "Unverified",
    "verify_layer",
    "recheck",
    "retime",
    "reverify",
    "weights_updating",
    "weights_update_begin",
]
__all__ += ["weights_update_end", "weights_update_open_s", "refusals", "record_refusal", "decide", "decisions", "STATE"]
__all__ += ["route", "route_table", "routes", "Served", "served_configurations", "served_layer", "check_served"]
__all__ += ["fingerprint_problem", "fingerprint_sweep", "report_sections", "on_hang", "use_group", "State"]
__all__ += ["record_unverified", "unverified"]

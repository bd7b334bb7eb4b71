"""Serving: this process's state in one owner (.state: ``STATE``, which uninstall() resets), records (.records),
layer checks (.layers), replacing (.replace), SELECT=fastest (.fastest, shared by the ranks through .collective),
re-checks (.updates)."""

from .collective import use_group
from .fastest import retime
from .records import (
    LayerCheck,
    Unverified,
    crashed,
    decide,
    decisions,
    record_unverified,
    refusals,
    refuse_now,
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
    fingerprints,
    on_hang,
    recheck,
    reverify,
    served_configurations,
    served_layer,
    weights_update_begin,
    weights_update_end,
    weights_update_open_s,
)

__all__ = [
    "LayerCheck",
    "crashed",
    "Unverified",
    "verify_layer",
    "recheck",
    "retime",
    "reverify",
    "weights_update_begin",
    "weights_update_end",
    "weights_update_open_s",
    "refusals",
    "refuse_now",
    "decide",
    "decisions",
    "STATE",
    "route",
    "route_table",
    "routes",
    "Served",
    "served_configurations",
    "served_layer",
    "check_served",
    "fingerprints",
    "report_sections",
    "on_hang",
    "use_group",
    "State",
    "record_unverified",
    "unverified",
]

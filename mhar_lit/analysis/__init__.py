"""Analysis of trained checkpoints: the query probe (docs/method.md G). See docs/probe.md."""

from mhar_lit.analysis.capture import capture_sources, observe_sources, routed_residual
from mhar_lit.analysis.probe import probe_main, probe_model
from mhar_lit.analysis.stats import RoutingStats

__all__ = ["capture_sources", "observe_sources", "routed_residual", "probe_main", "probe_model", "RoutingStats"]

"""Planning a campaign before it asks for a cluster: `milepost plan RECIPE`.

catalog.py: the shipped models' HF configs; arch.py: parameter and KV-cache counts from an HF
config; layout.py: parallel sizes, devices per role and the divisibility rules; memory.py:
memory per device with formulas; planner.py: puts them together and formats the report.
"""

from milepost.core.plan.catalog import CATALOG, resolve_architecture
from milepost.core.plan.planner import Plan, format_plan, make_plan

__all__ = ["CATALOG", "Plan", "format_plan", "make_plan", "resolve_architecture"]

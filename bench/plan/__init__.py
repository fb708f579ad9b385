"""`pdserve plan`: sizing advice for disaggregated serving from a measured profile.

``profile`` (the measured figures and their JSON), ``measure`` (measuring them with the
engine), ``model`` (the analytical planner, pure), ``report`` (the words), ``cli``.
"""

from bench.plan.model import (
    ColocatedPlan,
    DisaggregatedPlan,
    InfeasibleError,
    Mode,
    PlanError,
    Recommendation,
    Workload,
    plan,
)
from bench.plan.profile import Profile, ProfileError

__all__ = [
    "ColocatedPlan",
    "DisaggregatedPlan",
    "InfeasibleError",
    "Mode",
    "PlanError",
    "Profile",
    "ProfileError",
    "Recommendation",
    "Workload",
    "plan",
]

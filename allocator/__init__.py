"""Pure-Python memory solvers over buffer live intervals (Chen et al. 2016, Sec. 3, Fig. 2).

`liveness` gives the live-bytes profile and its peak (the lower bound), `sharing`
the tag-recycling plan of Chen et al. Fig. 2, `offsets` a greedy-by-size arena
layout. None of them imports torch.
"""

from .liveness import Interval, PeakOfSizes, PeakResult, live_bytes_profile, peak_live_bytes
from .mirror import SegmentPlan, grid_budgets, plan_segments, search_budgets, split_candidates
from .offsets import OffsetResult, assign_offsets, find_overlap
from .sharing import SharingResult, no_sharing_bytes, share_by_tags

__all__ = [
    "Interval",
    "OffsetResult",
    "PeakOfSizes",
    "PeakResult",
    "SegmentPlan",
    "SharingResult",
    "assign_offsets",
    "find_overlap",
    "grid_budgets",
    "live_bytes_profile",
    "no_sharing_bytes",
    "peak_live_bytes",
    "plan_segments",
    "search_budgets",
    "split_candidates",
    "share_by_tags",
]

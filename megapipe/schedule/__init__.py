"""megapipe.schedule: pipeline schedules as data (Python and numpy, no torch)."""

from .errors import ScheduleError
from .ir import Action, Kind, Schedule, ScheduleOptions, parse_action, read_csv, write_csv
from .p2p.comm_check import check_runs
from .p2p.lower import lower
from .combine.budget import apply_overlap_within
from .combine.combine_pass import apply_overlap
from .registry import SCHEDULES, build_schedule
from .checks.validate import validate

__all__ = [
    "Action",
    "Kind",
    "SCHEDULES",
    "Schedule",
    "ScheduleError",
    "ScheduleOptions",
    "apply_overlap",
    "apply_overlap_within",
    "build_schedule",
    "check_runs",
    "lower",
    "parse_action",
    "read_csv",
    "validate",
    "write_csv",
]

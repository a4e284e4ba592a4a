"""megapipe.schedule: pipeline schedules as data (Python and numpy, no torch).

Here: the data model (``ir``, ``actions``, ``table``, ``errors``), schedules by name
(``registry``) and what one rank runs (``rank_views``). ``families/``: the eight families'
generators; ``overlap_pass/``: the overlap pass; ``timing/``: the dependency rules and the in-order
engine; ``p2p/``: lowering and its proof; ``checks/``: validation.
"""

from .checks.validate import validate
from .errors import ScheduleError
from .ir import Action, Kind, Schedule, ScheduleOptions, parse_action, read_csv, write_csv
from .overlap_pass.apply import apply_overlap
from .overlap_pass.budget import apply_overlap_within
from .p2p.comm_check import check_batches
from .p2p.lower import lower
from .registry import SCHEDULES, build_schedule

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
    "check_batches",
    "lower",
    "parse_action",
    "read_csv",
    "validate",
    "write_csv",
]

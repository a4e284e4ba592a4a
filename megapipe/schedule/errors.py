"""The one error type of the schedule layer.

Every broken schedule rule raises ``ScheduleError``; its message says where (rank, action) and
which rule, so a user can find the offending cell of a schedule grid or CSV at once.
"""

from __future__ import annotations


class ScheduleError(ValueError):
    """A schedule, or a request for one, breaks a rule.

    ``rule`` says what is wrong; ``rank`` and ``action`` (when known) say where. The message reads
    ``"rank 2, action 1B3: <rule>"``. Errors about several ranks at once (a deadlock) pass
    ``rank=None`` and name the ranks in ``rule``.
    """

    def __init__(self, rule: str, rank: int | None = None, action: object | None = None) -> None:
        self.rule = rule
        self.rank = rank
        self.action = action
        where = []
        if rank is not None:
            where.append(f"rank {rank}")
        if action is not None:
            where.append(f"action {action}")
        prefix = ", ".join(where)
        super().__init__(f"{prefix}: {rule}" if prefix else rule)

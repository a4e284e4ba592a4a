"""What each computation needs and what it hands on: the dependency rules of a schedule.

A forward F(s, i) needs the output of F(s-1, i); a backward B or I of (s, i) needs its own
forward's activations and the input gradient of stage s+1 (on a last stage, the loss, computed by
its own forward); a W needs the I of the same stage and microbatch. When producer and consumer sit
on different ranks the tensor travels as a message, named by the sending side: ``("F", s, i)`` is
F(s, i)'s output, ``("B", s, i)`` stage s's input gradient of microbatch i.

The rules are data (``NEEDS``, ``MAKES``, ``SENDS``, ``CARRIES``): the functions below read them
for one action, ``megapipe.schedule.timing.flows`` for every computation of a schedule at once.
``timeline`` (``megapipe.schedule.timing.timeline``) runs a compute-only schedule by these rules.
"""

from __future__ import annotations

from ..actions import Action, Kind, plain_key
from ..ir import Schedule

# What a computation leaves behind for others: ("F" | "G" | "W", stage, microbatch), "G" being the
# input gradient (made by B or I alike).
Product = tuple[str, int, int]
# A tensor that travels between ranks, named by its sender: ("F" | "B", sending stage, microbatch).
Message = tuple[str, int, int]

# Offsets along a pipeline: the stage itself (0), the one before it (-1), the one after it (+1).
SELF, BEFORE, AFTER = 0, -1, 1
# Per plain computation: the products it needs, as (letter, where its stage lies), in order.
NEEDS: dict[Kind, tuple[tuple[str, int], ...]] = {
    Kind.F: (("F", BEFORE),),
    Kind.B: (("F", SELF), ("G", AFTER)),
    Kind.I: (("F", SELF), ("G", AFTER)),
    Kind.W: (("G", SELF),),
}
# The letter of the product each plain computation makes.
MAKES: dict[Kind, str] = {Kind.F: "F", Kind.B: "G", Kind.I: "G", Kind.W: "W"}
# The message a computation's product becomes when its consumer (this way) sits on another rank.
SENDS: dict[Kind, tuple[str, int]] = {
    Kind.F: ("F", AFTER),
    Kind.B: ("B", BEFORE),
    Kind.I: ("B", BEFORE),
}
# What a SEND or RECV carries: (message letter, where the sending stage lies, where the peer lies).
CARRIES: dict[Kind, tuple[str, int, int]] = {
    Kind.SEND_F: ("F", SELF, AFTER),
    Kind.SEND_B: ("B", SELF, BEFORE),
    Kind.RECV_F: ("F", BEFORE, BEFORE),
    Kind.RECV_B: ("B", AFTER, AFTER),
}


def neighbour(schedule: Schedule, stage: int, offset: int) -> int | None:
    """The stage ``offset`` away from ``stage`` in its pipeline (``SELF``, ``BEFORE``,
    ``AFTER``)."""
    if offset == SELF:
        return stage
    return schedule.prev_stage(stage) if offset == BEFORE else schedule.next_stage(stage)


def product_of(comp: Action) -> Product:
    """What a plain computation produces (B and I both produce the input gradient "G")."""
    letter = MAKES.get(comp.kind)
    if letter is None:
        raise ValueError(f"{comp} is not a plain computation (F, B, I or W)")
    return (letter, *plain_key(comp))


def needs_of(schedule: Schedule, comp: Action) -> list[Product]:
    """The products a plain computation needs, wherever they are made."""
    rules = NEEDS.get(comp.kind)
    if rules is None:
        raise ValueError(f"{comp} is not a plain computation (F, B, I or W)")
    own, microbatch = plain_key(comp)
    needs = []
    for letter, offset in rules:
        stage = neighbour(schedule, own, offset)
        if stage is not None:
            needs.append((letter, stage, microbatch))
    return needs


def rank_of_product(schedule: Schedule, product: Product) -> int:
    return schedule.stage_to_rank[product[1]]


def sent_message(schedule: Schedule, comp: Action) -> Message | None:
    """The message a computation's result becomes, or None if its consumer is on the same rank."""
    stage, microbatch = plain_key(comp)
    here = schedule.stage_to_rank[stage]
    rule = SENDS.get(comp.kind)
    if rule is None:
        return None
    target = neighbour(schedule, stage, rule[1])
    if target is None or schedule.stage_to_rank[target] == here:
        return None
    return (rule[0], stage, microbatch)


def received_message(schedule: Schedule, comp: Action) -> Message | None:
    """The message a computation must receive from another rank, or None.

    That is its need made on another rank, if any: for an F the previous stage's output, for a
    B or I the next stage's input gradient (a W needs only its own rank's I).
    """
    if comp.kind not in SENDS:
        return None
    here = schedule.stage_to_rank[plain_key(comp)[0]]
    for product, stage, mb in needs_of(schedule, comp):
        if schedule.stage_to_rank[stage] != here:
            return ("F" if product == "F" else "B", stage, mb)
    return None


def message_of_comm(schedule: Schedule, action: Action) -> Message:
    """The message a SEND or RECV action carries (named by the sending stage)."""
    rule = CARRIES.get(action.kind)
    if rule is None:
        raise ValueError(f"{action} is not a SEND or RECV action")
    stage, microbatch = plain_key(action)
    source = neighbour(schedule, stage, rule[1])
    return (rule[0], -1 if source is None else source, microbatch)


def peer_rank(schedule: Schedule, action: Action) -> int:
    """The rank on the other end of a SEND or RECV (an error if there is none)."""
    rule = CARRIES.get(action.kind)
    if rule is None:
        raise ValueError(f"{action} is not a SEND or RECV action")
    other = neighbour(schedule, plain_key(action)[0], rule[2])
    if other is None:
        raise ValueError(
            f"{action} has no peer: stage {action.stage} is at the end of its pipeline"
        )
    return schedule.stage_to_rank[other]


# Relative durations used when none are given: a backward costs two forwards, and I and W one
# each (the usual F=1, B=2, W=1 of the zero-bubble and DualPipe papers). An OVERLAP costs the
# sum of its halves unless ``Kind.OVERLAP`` is given.
DEFAULT_DURATIONS: dict[Kind, float] = {Kind.F: 1.0, Kind.B: 2.0, Kind.I: 1.0, Kind.W: 1.0}


def missing_needs(schedule: Schedule, action: Action, made) -> list[Product]:
    """The products an action (an OVERLAP's halves included) needs that are not in ``made``."""
    return [
        need
        for comp in action.computations()
        for need in needs_of(schedule, comp)
        if need not in made
    ]


def describe_product(schedule: Schedule, product: Product) -> str:
    kind, stage, mb = product
    text = {"F": f"{stage}F{mb}", "G": f"{stage}B/I{mb}", "W": f"{stage}W{mb}"}[kind]
    return f"{text} (rank {schedule.stage_to_rank[stage]})"

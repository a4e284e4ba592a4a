"""The ``megapipe`` command: every subcommand declared one way (``subcommand.Subcommand``).

``SUBCOMMANDS`` lists them; each adds its arguments, checks them (``check``: one ``ArgsError``
line naming the value, exit code 2, before anything runs) and runs. ``megapipe schedule NAME
--pp P [--vpp V] -m M [--overlap [--max-extra-in-flight K]]`` builds a schedule, prints it as a
rank-by-step grid with its simulated metrics (with overlap also the peak in flight plain and
combined and the makespan at each in-flight budget; with ``--dp-reduce T`` the data-parallel
reduction after the step and overlapped), and optionally writes it as CSV (torch's format), a
PNG timeline and a Chrome trace. ``megapipe schedule --pick --pp P -m M --activation-bytes B
--memory-budget BYTES`` instead prints the fastest schedule, vpp, in-flight budget and recompute
choice whose activations fit (``sim/pick.py``). ``pretrain`` and the subcommands of the data,
checkpoint and observation rooms (``data.commands``, ``train.checkpoint.export_command``,
``train.observe.trace_command``: ``trace summarize``) are declared the same way.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from collections.abc import Sequence

from .data.commands import PREPROCESS_DATA, TRAIN_TOKENIZER
from .schedule.errors import ScheduleError
from .subcommand import ArgsError, Subcommand, at_least, check_values, writable_file
from .train.checkpoint.export_command import EXPORT_HF
from .train.config.flags import DESCRIPTION as PRETRAIN_DESCRIPTION
from .train.observe.trace_command import TRACE


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing the usage block, so errors stay one line."""

    def error(self, message: str):
        raise ArgsError(message)


def _schedule_arguments(p: argparse.ArgumentParser) -> None:
    """The ``schedule`` subcommand's arguments, in groups: the schedule, its costs, the pick
    among schedules, and what to write."""
    _shape_arguments(p)
    _cost_arguments(p)
    _pick_arguments(p)
    p.add_argument("--csv", metavar="FILE", help="write the schedule as CSV (torch's format)")
    p.add_argument("--png", metavar="FILE", help="draw the simulated timeline to a PNG")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in Perfetto)")


def _shape_arguments(p: argparse.ArgumentParser) -> None:
    """Which schedule: its name, pipeline ranks, stages per rank, microbatches, the overlap."""
    from .schedule.registry import SCHEDULES

    p.add_argument(
        "name", nargs="?", help=f"schedule name: {', '.join(SCHEDULES)} (none with --pick)"
    )
    p.add_argument("--pp", type=int, required=True, help="pipeline ranks")
    p.add_argument(
        "--vpp", type=int, default=None, help="stages per rank (interleaved-1f1b, looped-bfs, zb1p)"
    )
    p.add_argument(
        "-m",
        "--num-microbatches",
        type=int,
        required=True,
        dest="num_microbatches",
        help="microbatches per step",
    )
    p.add_argument(
        "--overlap",
        action="store_true",
        help="pair forwards with backwards (OVERLAP) to hide the all-to-all",
    )
    p.add_argument(
        "--max-extra-in-flight",
        type=int,
        default=None,
        metavar="K",
        help="with --overlap (implied): at most K more microbatch-stages in flight on "
        "any rank than the plain schedule (default: no budget)",
    )


def _cost_arguments(p: argparse.ArgumentParser) -> None:
    """What each action costs in the simulation, and the data-parallel reduction after it."""
    p.add_argument(
        "--costs",
        default="1,2,1",
        metavar="F,B,W[,A2A]",
        help="per-stage costs of forward, full backward and weight-gradient backward, "
        "and optionally of each all-to-all (default 1,2,1: free all-to-all)",
    )
    p.add_argument(
        "--moe-layers",
        type=int,
        default=1,
        help="MoE layers per stage, each with a dispatch and a combine (default 1)",
    )
    p.add_argument("--p2p-latency", type=float, default=0.0, help="stage-to-stage latency")
    p.add_argument(
        "--dp-reduce",
        type=float,
        default=None,
        metavar="T",
        help="time of one stage's data-parallel gradient reduction: also print how "
        "much of it is exposed after the step and overlapped with the backward",
    )
    p.add_argument(
        "--dp-buckets",
        type=int,
        default=1,
        metavar="N",
        help="with --dp-reduce: buckets per stage (default 1)",
    )


def _pick_arguments(p: argparse.ArgumentParser) -> None:
    """``--pick``: the fastest choice whose activations fit a memory budget, and its inputs."""
    p.add_argument(
        "--pick",
        action="store_true",
        help="print the fastest schedule, vpp, in-flight budget K and recompute choice "
        "whose activations fit --memory-budget (needs --activation-bytes)",
    )
    p.add_argument(
        "--memory-budget",
        type=float,
        default=None,
        metavar="BYTES",
        help="with --pick: activation bytes any rank may hold",
    )
    p.add_argument(
        "--activation-bytes",
        type=float,
        default=None,
        metavar="BYTES",
        help="with --pick: activation bytes of one plain stage (1/pp of the layers) "
        "for one microbatch",
    )
    p.add_argument(
        "--recompute-saves",
        type=float,
        default=0.3,
        metavar="FRACTION",
        help="with --pick: part of the activation bytes selective recompute no longer "
        "keeps (default 0.3: it keeps 0.7)",
    )
    p.add_argument(
        "--recompute-cost",
        type=float,
        default=0.3,
        metavar="FRACTION",
        help="with --pick: part of F that selective recompute re-runs in each "
        "backward (default 0.3)",
    )
    p.add_argument(
        "--full-recompute-saves",
        type=float,
        default=0.7,
        metavar="FRACTION",
        help="with --pick: part of the activation bytes full recompute no longer "
        "keeps (default 0.7; the demo model measures 0.57)",
    )
    p.add_argument(
        "--full-recompute-cost",
        type=float,
        default=1.0,
        metavar="FRACTION",
        help="with --pick: part of F that full recompute re-runs in each backward "
        "(default 1: the whole forward)",
    )


_POSITIVE, _COUNT = (at_least(1),), (at_least(0),)


def _check_schedule(args: argparse.Namespace) -> argparse.Namespace:
    """Each value in its range, the files writable, ``--pick``'s needs; returns the arguments
    with ``costs`` parsed into ``sim.costs.Costs``."""
    from .sim.costs import Costs

    check_values(
        args,
        {
            "--pp": _POSITIVE,
            "--vpp": _POSITIVE,
            "--num-microbatches": _POSITIVE,
            "--max-extra-in-flight": _COUNT,
            "--moe-layers": _COUNT,
            "--dp-buckets": _POSITIVE,
            "--csv": (writable_file,),
            "--png": (writable_file,),
            "--trace": (writable_file,),
        },
    )
    if args.pick and args.name is not None:
        raise ArgsError(f"--pick chooses the schedule itself; drop the name {args.name!r}")
    for flag in ("memory_budget", "activation_bytes") if args.pick else ():
        if getattr(args, flag) is None:
            raise ArgsError(f"--pick needs --{flag.replace('_', '-')} BYTES")
    if not args.pick and args.name is None:
        raise ArgsError("the following arguments are required: name (or --pick)")
    try:
        costs = Costs.from_text(
            args.costs, moe_layers=args.moe_layers, p2p_latency=args.p2p_latency
        )
    except ValueError as err:
        raise ArgsError(f"--costs {args.costs}: {err}".splitlines()[0]) from None
    return argparse.Namespace(**{**vars(args), "costs": costs})


def run_schedule_command(args: argparse.Namespace) -> int:
    """``megapipe schedule``: build, print, simulate, and write the requested files."""
    from .schedule.ir import write_csv
    from .schedule.registry import build_schedule
    from .sim.simulate import simulate

    costs = args.costs
    if args.pick:
        return _run_pick(args, costs)
    extra = {} if args.vpp is None else {"vpp": args.vpp}
    overlap = args.overlap or args.max_extra_in_flight is not None
    schedule = build_schedule(
        args.name,
        args.pp,
        args.num_microbatches,
        overlap=overlap,
        max_extra_in_flight=args.max_extra_in_flight,
        **extra,
    )
    result = simulate(schedule, costs)
    vpp = schedule.options.vpp
    budget = "" if args.max_extra_in_flight is None else f" (K={args.max_extra_in_flight})"
    title = (
        f"{args.name}{' + overlap' + budget if overlap else ''}: pp={args.pp} vpp={vpp} "
        f"microbatches={args.num_microbatches}"
    )
    print(title)
    print(schedule.format_grid())
    print()
    print(f"simulated with {costs.describe()}")
    print(result.summary())
    if args.dp_reduce is not None:
        from .sim.dp_reduction import DPCosts, dp_reduction

        print(dp_reduction(schedule, result, DPCosts(args.dp_reduce, args.dp_buckets)).summary())
    if overlap:
        _print_budgets(args, costs, extra)
    if args.csv:
        write_csv(schedule, args.csv)
        print(f"wrote {args.csv}")
    if args.png:
        from .sim.draw import draw_timeline

        draw_timeline(result, args.png, title=title, stage_to_rank=schedule.stage_to_rank)
        print(f"wrote {args.png}")
    if args.trace:
        from .sim.trace import write_trace

        write_trace(result, args.trace)
        print(f"wrote {args.trace}")
    return 0


def _print_budgets(args: argparse.Namespace, costs, extra: dict) -> None:
    """Peak in flight plain and combined, and the simulated makespan at each budget K."""
    from .sim.budget_sweep import budget_sweep, format_sweep

    plain, points = budget_sweep(args.name, args.pp, args.num_microbatches, costs, **extra)
    chosen = next(p for p in points if p.budget == args.max_extra_in_flight)
    print()
    print(f"peak in flight plain     {' '.join(map(str, plain.peak_in_flight))}")
    print(f"peak in flight combined  {' '.join(map(str, chosen.peak_in_flight))}")
    print("the trade by in-flight budget (--max-extra-in-flight K):")
    print(format_sweep(plain, points))


def _pretrain_arguments(p: argparse.ArgumentParser) -> None:
    from .train.config.declare import add_flags
    from .train.config.flags import PretrainFlags  # imports no torch

    add_flags(p, PretrainFlags)


def _check_pretrain(args: argparse.Namespace):  # -> JobConfig (its module imports no torch)
    """Every flag's checks, then the config checked and built in one pass (``train.config``)."""
    from .train.config.parse import args_from_namespace

    return args_from_namespace(args)


def run_pretrain_command(config) -> int:  # config: JobConfig
    """``megapipe pretrain``: the training app, ``megapipe.train``."""
    from .train.main import run

    return run(config)


def _run_pick(args: argparse.Namespace, costs) -> int:
    """``megapipe schedule --pick``: the fastest choice whose activations fit the budget."""
    from .sim.pick import Recompute, all_choices, format_pick

    recompute = Recompute(saves=args.recompute_saves, cost=args.recompute_cost)
    full = Recompute(saves=args.full_recompute_saves, cost=args.full_recompute_cost)
    choices = all_choices(
        args.pp, args.num_microbatches, costs, args.activation_bytes, recompute, full
    )
    text = format_pick(choices, args.memory_budget)
    print(text)
    return 0 if not text.startswith("no choice fits") else 1


SCHEDULE = Subcommand(
    "schedule",
    "print a pipeline schedule and its simulated bubble",
    "Build a pipeline schedule, print it as a rank-by-step grid and simulate it.",
    _schedule_arguments,
    _check_schedule,
    run_schedule_command,
)
PRETRAIN = Subcommand(
    "pretrain",
    "pretrain an MoE GPT (Megatron's flags; no flags: the CPU demo, 4 processes)",
    PRETRAIN_DESCRIPTION,
    _pretrain_arguments,
    _check_pretrain,
    run_pretrain_command,
)
SUBCOMMANDS: tuple[Subcommand, ...] = (
    SCHEDULE,
    PRETRAIN,
    TRACE,
    TRAIN_TOKENIZER,
    PREPROCESS_DATA,
    EXPORT_HF,
)


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser: one subparser per ``SUBCOMMANDS`` entry, which it carries as
    ``args.subcommand``."""
    parser = _Parser(prog="megapipe", description="Pipeline schedules for MoE training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    for command in SUBCOMMANDS:
        p = subparsers.add_parser(command.name, help=command.help, description=command.description)
        command.arguments(p)
        p.set_defaults(subcommand=command)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``megapipe`` command; returns the exit code."""
    from .train.failures import debug_enabled

    try:
        args = build_parser().parse_args(argv)
        command: Subcommand = args.subcommand
        return command.run(command.check(args))
    except (ScheduleError, ValueError, OSError) as error:  # ArgsError is a ValueError
        if debug_enabled():
            traceback.print_exc()
        message = str(error).splitlines()[0] if str(error) else type(error).__name__
        print(f"megapipe: error: {message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("megapipe: interrupted", file=sys.stderr)
        return 130
    except Exception as error:  # a bug: one line, the traceback with MEGAPIPE_DEBUG=1
        if debug_enabled():
            traceback.print_exc()
        message = str(error).splitlines()[0] if str(error) else ""
        print(
            f"megapipe: internal error: {type(error).__name__}: {message} "
            "(MEGAPIPE_DEBUG=1 shows the traceback)",
            file=sys.stderr,
        )
        return 1


if __name__ == "__main__":
    sys.exit(main())

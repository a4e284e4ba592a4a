"""The ``megapipe`` command. One subcommand per job, one function per subcommand.

``megapipe schedule NAME --pp P [--vpp V] -m M [--overlap [--max-extra-in-flight K]]`` builds a
schedule, prints it as a rank-by-step grid with its simulated metrics (with overlap also the
peak in flight plain and combined and the makespan at each in-flight budget; with
``--dp-reduce T`` the data-parallel reduction after the step and overlapped), and optionally
writes it as CSV (torch's format), a PNG timeline and a Chrome trace. ``megapipe schedule --pick
--pp P -m M --activation-bytes B --memory-budget BYTES`` instead prints the fastest schedule,
vpp, in-flight budget and recompute choice whose activations fit (``sim/pick.py``). Bad arguments
end with a one-line error and exit code 2.
"""

from __future__ import annotations

import argparse
import sys
import traceback
from typing import Callable, Sequence

from .data.commands import add_data_commands
from .schedule.errors import ScheduleError


class _UsageError(Exception):
    """A bad argument: reported as one line, exit code 2."""


class _Parser(argparse.ArgumentParser):
    """argparse that raises instead of printing the usage block, so errors stay one line."""

    def error(self, message: str):
        raise _UsageError(message)


def _int_at_least(low: int, wanted: str) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``low``, else an error naming ``wanted``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {text!r}") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"expected {wanted}, got {value}")
        return value

    return parse


_positive_int = _int_at_least(1, "a positive integer")
_non_negative_int = _int_at_least(0, "an integer >= 0")


def _add_schedule_command(subparsers) -> None:
    from .schedule.registry import SCHEDULES

    p = subparsers.add_parser(
        "schedule",
        help="print a pipeline schedule and its simulated bubble",
        description="Build a pipeline schedule, print it as a rank-by-step grid and simulate it.",
    )
    p.add_argument("name", nargs="?", help=f"schedule name: {', '.join(SCHEDULES)} (none with --pick)")
    p.add_argument("--pp", type=_positive_int, required=True, help="pipeline ranks")
    p.add_argument("--vpp", type=_positive_int, default=None,
                   help="stages per rank (interleaved-1f1b, looped-bfs, zb1p)")
    p.add_argument("-m", "--num-microbatches", type=_positive_int, required=True,
                   dest="num_microbatches", help="microbatches per step")
    p.add_argument("--overlap", action="store_true",
                   help="pair forwards with backwards (OVERLAP) to hide the all-to-all")
    p.add_argument("--max-extra-in-flight", type=_non_negative_int, default=None, metavar="K",
                   help="with --overlap (implied): at most K more microbatch-stages in flight on "
                        "any rank than the plain schedule (default: no budget)")
    p.add_argument("--costs", default="1,2,1", metavar="F,B,W[,A2A]",
                   help="per-stage costs of forward, full backward and weight-gradient backward, "
                        "and optionally of each all-to-all (default 1,2,1: free all-to-all)")
    p.add_argument("--moe-layers", type=int, default=1,
                   help="MoE layers per stage, each with a dispatch and a combine (default 1)")
    p.add_argument("--p2p-latency", type=float, default=0.0, help="stage-to-stage latency")
    p.add_argument("--dp-reduce", type=float, default=None, metavar="T",
                   help="time of one stage's data-parallel gradient reduction: also print how "
                        "much of it is exposed after the step and overlapped with the backward")
    p.add_argument("--dp-buckets", type=_positive_int, default=1, metavar="N",
                   help="with --dp-reduce: buckets per stage (default 1)")
    p.add_argument("--pick", action="store_true",
                   help="print the fastest schedule, vpp, in-flight budget K and recompute choice "
                        "whose activations fit --memory-budget (needs --activation-bytes)")
    p.add_argument("--memory-budget", type=float, default=None, metavar="BYTES",
                   help="with --pick: activation bytes any rank may hold")
    p.add_argument("--activation-bytes", type=float, default=None, metavar="BYTES",
                   help="with --pick: activation bytes of one plain stage (1/pp of the layers) "
                        "for one microbatch")
    p.add_argument("--recompute-saves", type=float, default=0.3, metavar="FRACTION",
                   help="with --pick: part of the activation bytes selective recompute no longer "
                        "keeps (default 0.3: it keeps 0.7)")
    p.add_argument("--recompute-cost", type=float, default=0.3, metavar="FRACTION",
                   help="with --pick: part of F that selective recompute re-runs in each "
                        "backward (default 0.3)")
    p.add_argument("--full-recompute-saves", type=float, default=0.7, metavar="FRACTION",
                   help="with --pick: part of the activation bytes full recompute no longer "
                        "keeps (default 0.7; the demo model measures 0.57)")
    p.add_argument("--full-recompute-cost", type=float, default=1.0, metavar="FRACTION",
                   help="with --pick: part of F that full recompute re-runs in each backward "
                        "(default 1: the whole forward)")
    p.add_argument("--csv", metavar="FILE", help="write the schedule as CSV (torch's format)")
    p.add_argument("--png", metavar="FILE", help="draw the simulated timeline to a PNG")
    p.add_argument("--trace", metavar="FILE", help="write a Chrome trace (open in Perfetto)")
    p.set_defaults(handler=run_schedule_command)



def run_schedule_command(args: argparse.Namespace) -> int:
    """``megapipe schedule``: build, print, simulate, and write the requested files."""
    from .schedule.ir import write_csv
    from .schedule.registry import build_schedule
    from .sim.costs import Costs
    from .sim.simulate import simulate
    from .train.config.checks import check_output_path

    for flag in ("csv", "png", "trace"):
        check_output_path(flag, getattr(args, flag))
    costs = Costs.from_text(args.costs, moe_layers=args.moe_layers, p2p_latency=args.p2p_latency)
    if args.pick:
        return _run_pick(args, costs)
    if args.name is None:
        raise _UsageError("the following arguments are required: name (or --pick)")
    extra = {} if args.vpp is None else {"vpp": args.vpp}
    overlap = args.overlap or args.max_extra_in_flight is not None
    schedule = build_schedule(
        args.name, args.pp, args.num_microbatches, overlap=overlap,
        max_extra_in_flight=args.max_extra_in_flight, **extra,
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


def _add_pretrain_command(subparsers) -> None:
    from .train.config.flags import build_parser as pretrain_flags

    p = subparsers.add_parser(
        "pretrain",
        parents=[pretrain_flags(add_help=False)],
        help="pretrain an MoE GPT (Megatron's flags; no flags: the CPU demo, 4 processes)",
        description="Pretrain an MoE GPT with pipeline x expert x data parallelism. With no "
        "flags: a small model on CPU, pp=2 vpp=2 ep=2, overlap on, 4 processes.",
    )
    p.set_defaults(handler=run_pretrain_command)


def run_pretrain_command(args: argparse.Namespace) -> int:
    """``megapipe pretrain``: the training app, ``megapipe.train``."""
    from .train.main import main_from_namespace

    return main_from_namespace(args)


def _add_trace_command(subparsers) -> None:
    p = subparsers.add_parser(
        "trace", help="read a profile trace of a run (megapipe pretrain --profile-trace)",
        description="Read a profile trace written by megapipe pretrain --profile-trace.",
    )
    actions = p.add_subparsers(dest="trace_command", metavar="ACTION", parser_class=_Parser)
    actions.required = True
    summarize = actions.add_parser(
        "summarize", help="per rank: exposed all-to-all, largest bubbles; measured vs simulated",
    )
    summarize.add_argument("file", help="the trace (JSON) --profile-trace wrote")
    summarize.set_defaults(handler=run_trace_summarize)


def run_trace_summarize(args: argparse.Namespace) -> int:
    """``megapipe trace summarize FILE``: print the trace's figures
    (``train.observe.trace_summary``)."""
    from .train.observe.trace_summary import summarize_file

    print(summarize_file(args.file))
    return 0


def _run_pick(args: argparse.Namespace, costs) -> int:
    """``megapipe schedule --pick``: the fastest choice whose activations fit the budget."""
    from .sim.pick import Recompute, all_choices, format_pick

    if args.name is not None:
        raise _UsageError(f"--pick chooses the schedule itself; drop the name {args.name!r}")
    for flag in ("memory_budget", "activation_bytes"):
        if getattr(args, flag) is None:
            raise _UsageError(f"--pick needs --{flag.replace('_', '-')} BYTES")
    recompute = Recompute(saves=args.recompute_saves, cost=args.recompute_cost)
    full = Recompute(saves=args.full_recompute_saves, cost=args.full_recompute_cost)
    choices = all_choices(args.pp, args.num_microbatches, costs, args.activation_bytes,
                          recompute, full)
    text = format_pick(choices, args.memory_budget)
    print(text)
    return 0 if not text.startswith("no choice fits") else 1


def build_parser() -> argparse.ArgumentParser:
    """The top-level parser; each subcommand registers itself with ``set_defaults(handler=...)``."""
    parser = _Parser(prog="megapipe", description="Pipeline schedules for MoE training.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=_Parser)
    subparsers.required = True
    _add_schedule_command(subparsers)
    _add_pretrain_command(subparsers)
    _add_trace_command(subparsers)
    add_data_commands(subparsers)
    from .train.checkpoint.export_command import add_export_command
    add_export_command(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``megapipe`` command; returns the exit code."""
    from .train.failures import debug_enabled

    try:
        args = build_parser().parse_args(argv)
        return args.handler(args)
    except (_UsageError, ScheduleError, ValueError, OSError) as error:
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
        print(f"megapipe: internal error: {type(error).__name__}: {message} "
              "(MEGAPIPE_DEBUG=1 shows the traceback)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())

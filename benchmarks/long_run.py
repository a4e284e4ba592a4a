"""Memory over a long run of the default demo: does anything grow per iteration? (issue 41)

Runs ``megapipe pretrain`` (the default job: 4 gloo ranks on CPU, pp 2, vpp 2, ep 2, dp 2) for
``--iters`` iterations in each setting, through the real training loop (``train``), and every
``--every`` iterations samples on each rank:

- resident bytes (``/proc/self/statm``);
- the C heap's bytes in use and free (glibc's ``mallinfo2`` through ctypes: in use = allocated
  chunks + mmapped blocks; free = what the allocator keeps without returning it);
- live tensor bytes (the distinct storages of the tensors the garbage collector tracks:
  parameters, optimizer state, anything kept past the step) and the count of tracked objects.

Per setting and rank it prints the values at the end and their slope (least squares, per
iteration) over the last half of the run, after warm-up, and the slopes of resident memory at
the end of each ``--window`` iterations (floor) and of its maximum in each (peak): the trim makes
it a saw. The last column is the slope of the heap's free bytes: resident memory that grows while
the bytes in use stay flat is free heap the allocator spreads over more pages (fragmentation).
``--reprint FILE`` prints a ``--rows`` file's table again. Settings (``--settings``):
``overlap`` (the default: combined steps with their node trace, the heap trimmed every 100
iterations), ``plain`` (``--no-overlap-moe-expert-parallel-comm``, no node trace), ``wgrad``
(``--delay-wgrad-compute``), ``manual-gc`` (``--manual-gc --manual-gc-interval 100``, the
collections at the trim's iterations, ``train/manual_gc.py``), ``no-trim``
(``--heap-trim-interval 0``: the C heap's free pages kept). Extra pretrain flags go after ``--``.
The issue's target is 5,000 iterations (``--iters 5000``); the default demo runs about 3
iterations per second on 2 cores:

    python benchmarks/long_run.py --iters 600 [--settings overlap,plain] [--rows FILE]
        [-- PRETRAIN FLAGS]
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megapipe.train.config.parse import parse_pretrain_args
from megapipe.train.loop import train
from spawn_ranks import run_ranks

WORLD = 4
GC_INTERVAL = 100
SETTINGS = {
    "overlap": [],
    "plain": ["--no-overlap-moe-expert-parallel-comm"],
    "wgrad": ["--delay-wgrad-compute"],
    "manual-gc": ["--manual-gc", "--manual-gc-interval", str(GC_INTERVAL)],
    "no-trim": ["--heap-trim-interval", "0"],
}
FIELDS = ("rss", "heap_used", "heap_free", "tensors", "objects")
PARTIAL_EVERY = 25  # samples between the partial files' updates (a run of 5,000 takes an hour)


class _Mallinfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


def _libc() -> ctypes.CDLL:
    libc = ctypes.CDLL("libc.so.6")
    libc.mallinfo2.restype = _Mallinfo2
    return libc


def sample(libc: ctypes.CDLL) -> tuple[int, ...]:
    """(resident, heap in use, heap free, live tensor bytes, tracked objects) of this process."""
    with open("/proc/self/statm") as f:
        rss = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    info = libc.mallinfo2()
    objects = gc.get_objects()
    storages: dict[int, int] = {}
    for obj in objects:
        if issubclass(type(obj), torch.Tensor):  # type(): no proxy's __class__ runs
            try:
                storage = obj.untyped_storage()
            except (RuntimeError, NotImplementedError):  # a tensor without storage
                continue
            storages[storage.data_ptr()] = storage.nbytes()
    count = len(objects)
    del objects
    return rss, info.uordblks + info.hblkhd, info.fordblks, sum(storages.values()), count


@dataclass(frozen=True)
class Settings:
    argv: tuple[str, ...]
    every: int
    partial: str | None = None  # where rank 0 writes the samples so far, every PARTIAL_EVERY
    name: str = ""


def _worker(rank: int, s: Settings, out) -> None:
    dist.init_process_group("gloo")
    libc = _libc()
    rows: list[tuple[int, ...]] = []

    def probe(iteration: int) -> None:
        if iteration % s.every == 0:
            rows.append((iteration, *sample(libc)))
            if s.partial and len(rows) % PARTIAL_EVERY == 0:  # same iteration on every rank
                _write_partial(s, rows)

    train(parse_pretrain_args(list(s.argv), env={}), write=lambda line: None,
          on_iteration=probe)
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if rank == 0:
        out.put(everyone)
    dist.destroy_process_group()


def _write_partial(s: Settings, rows: list[tuple[int, ...]]) -> None:
    """The samples so far of every rank, as a ``--rows`` file of this setting (``--reprint``
    reads it): a long run that is stopped early still says what it measured."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, rows)
    if dist.get_rank() == 0:
        with open(s.partial, "w") as f:
            json.dump({"fields": ["iteration", *FIELDS], "samples": {s.name: everyone}}, f)


def slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs (nan below two points: a run shorter than two
    windows has no floor or peak slope)."""
    n = len(xs)
    if n < 2:
        return float("nan")
    mx, my = sum(xs) / n, sum(ys) / n
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den else 0.0


def summarize(rows: list[tuple[int, ...]]) -> dict[str, tuple[float, float]]:
    """Per field: (value at the end, slope per iteration over the last half of the samples)."""
    half = rows[len(rows) // 2:]
    xs = [float(r[0]) for r in half]
    return {name: (float(rows[-1][k + 1]), slope(xs, [float(r[k + 1]) for r in half]))
            for k, name in enumerate(FIELDS)}


def saw_slopes(rows: list[tuple[int, ...]], window: int) -> tuple[float, float]:
    """Slopes per iteration, over the last half, of resident memory at the end of each ``window``
    (the floor: right after a trim every ``window`` iterations) and of its maximum in each window
    (the peak): with the trim resident memory is a saw, dropping at each trim while the next steps
    take the pages back, so the plain least-squares slope mostly says where the last sample fell."""
    half = rows[len(rows) // 2:]
    floor = [(float(r[0]), float(r[1])) for r in half if r[0] % window == 0]
    peaks: dict[int, int] = {}
    for r in half:
        w = (r[0] - 1) // window
        peaks[w] = max(peaks.get(w, 0), r[1])
    return (slope([x for x, _ in floor], [y for _, y in floor]),
            slope([float(w * window) for w in peaks], [float(v) for v in peaks.values()]))


def format_rows(setting: str, per_rank: list[list[tuple[int, ...]]], window: int) -> list[str]:
    lines = []
    for rank, rows in enumerate(per_rank):
        got = summarize(rows)
        end = {k: v[0] for k, v in got.items()}
        per = {k: v[1] for k, v in got.items()}
        lines.append(
            f"{setting:<10}{rank:>5}{end['rss'] / 2**20:>9.1f}{per['rss']:>10.0f}"
            + "{:>11.0f}{:>10.0f}".format(*saw_slopes(rows, window)) +
            f"{end['heap_used'] / 2**20:>9.1f}{per['heap_used']:>10.0f}"
            f"{end['heap_free'] / 2**20:>9.1f}{end['tensors'] / 2**20:>9.2f}"
            f"{per['tensors']:>9.0f}{end['objects']:>10.0f}{per['objects']:>8.2f}"
            f"{per['heap_free']:>10.0f}")
    return lines


HEADER = (f"{'setting':<10}{'rank':>5}{'RSS MiB':>9}{'B/iter':>10}{'floor B/it':>11}"
          f"{'peak B/it':>10}{'heap MiB':>9}{'B/iter':>10}"
          f"{'free MiB':>9}{'tens MiB':>9}{'B/iter':>9}{'objects':>10}{'/iter':>8}"
          f"{'free B/it':>10}")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=600, help="iterations per setting")
    p.add_argument("--every", type=int, default=10, help="iterations between samples")
    p.add_argument("--rows", metavar="FILE",
                   help="also write every sample, per setting and rank, to FILE as JSON (and "
                        "the samples so far to FILE.partial while a setting runs)")
    p.add_argument("--window", type=int, default=100,
                   help="iterations per window of the peak's slope (the default "
                        "--heap-trim-interval)")
    p.add_argument("--reprint", metavar="FILE",
                   help="print the table of a --rows FILE instead of running")
    p.add_argument("--settings", default="overlap,plain,wgrad,manual-gc",
                   help=f"comma-separated, of {', '.join(SETTINGS)}")
    args = p.parse_args(argv[:split])
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown or not names:
        p.error(f"--settings must name some of {', '.join(SETTINGS)}, got {unknown or names}")
    if args.iters < 4 * args.every:
        p.error(f"--iters={args.iters} needs at least 4 samples (--every {args.every})")
    if args.reprint:
        with open(args.reprint) as f:
            saved = json.load(f)["samples"]
        print(HEADER)
        for name, per_rank in saved.items():
            print("\n".join(format_rows(name, per_rank, args.window)))
        return 0
    flags = argv[split + 1:]
    print(f"megapipe pretrain {' '.join(flags)} --train-iters {args.iters}: per rank, the "
          f"value at the end and its slope per iteration over iterations "
          f"{args.iters // 2}-{args.iters} (a sample every {args.every})")
    print(HEADER)
    samples: dict[str, list] = {}
    for name in names:
        pretrain = (*flags, *SETTINGS[name], "--train-iters", str(args.iters))
        partial = f"{args.rows}.partial" if args.rows else None
        per_rank = run_ranks(_worker, WORLD, Settings(pretrain, args.every, partial, name))
        print("\n".join(format_rows(name, per_rank, args.window)), flush=True)
        samples[name] = per_rank
        if args.rows:
            with open(args.rows, "w") as f:
                json.dump({"fields": ["iteration", *FIELDS], "samples": samples}, f)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

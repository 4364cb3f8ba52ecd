# SPDX-License-Identifier: Apache-2.0
"""What the driver prints and writes: nccl-tests tables, the side-by-side summary, the machine line, JSON, plots."""
import json
import math
import os
import platform
import sys

from benchmarks.backends import MPI_NAMES

# The summary compares the form applications use most: allreduce and broadcast in place (gradients, parameters),
# the others out of place (shmcomm has no in-place form of them).
PREFERRED_HALF = {"allreduce": "in_place", "broadcast": "in_place"}
HALVES = ("out_of_place", "in_place")
HALF_NAMES = {"out_of_place": "out-of-place", "in_place": "in-place"}
FASTER_MPI = "faster MPI"  # the summary's ratio to whichever MPI is faster at that size

_LEFT = "# %10s  %12s  %8s  %6s  %6s"
_ROW = "%12d  %12d  %8s  %6s  %6d"
_HALF_HEAD = "  %7s  %6s  %6s %6s"
_HALF_ROW = "  %7s  %6.2f  %6.2f  %5s"
_HALF_NA = "  %7s  %6s  %6s  %5s" % ("N/A", "N/A", "N/A", "N/A")
_EXTRA = "  %7s  %7s"  # -v: p50 and p99


def format_time(us):
    """As nccl-tests: fewer decimals as times grow, always 7 characters."""
    if us >= 10000.0:
        return "%7.0f" % us
    if us >= 100.0:
        return "%7.1f" % us
    return "%7.2f" % us


def table_lines(result, op, verbose=False):
    """One nccl-tests table: the header, one line per size, then the N/A reasons and the #wrong verdict."""
    rows = [row for row in result["rows"] if row["op"] == op]
    extra_head = _EXTRA % ("p50", "p99") if verbose else ""
    half_width = len(_HALF_HEAD % ("", "", "", "")) + len(extra_head)
    left_width = len(_LEFT % ("", "", "", "", ""))
    lines = ["#",
             "# %s %s: %d rank%s, %s (%s); times are medians over iterations of the slowest rank's time" % (
                 result["backend"], op, result["nranks"], "" if result["nranks"] == 1 else "s", result["dtype"],
                 result["library"]),
             "#",
             "#" + " " * (left_width - 1) + "out-of-place".center(half_width) + "in-place".center(half_width).rstrip(),
             _LEFT % ("size", "count", "type", "redop", "root")
             + (_HALF_HEAD % ("time", "algbw", "busbw", "#wrong") + extra_head) * 2,
             (_LEFT % ("(B)", "(elements)", "", "", "")
              + (_HALF_HEAD % ("(us)", "(GB/s)", "(GB/s)", "") + (_EXTRA % ("(us)", "(us)") if verbose else "")) * 2
              ).rstrip()]
    wrong, missing = 0, {}
    for row in rows:
        line = _ROW % (row["size"], row["count"], row["type"], row["redop"], row["root"])
        for half in HALVES:
            cell = row[half]
            if "na" in cell:
                missing.setdefault(cell["na"], []).append(HALF_NAMES[half])
                line += _HALF_NA + (_EXTRA % ("N/A", "N/A") if verbose else "")
                continue
            wrong += cell["wrong"]
            line += _HALF_ROW % (format_time(cell["time_us"]), cell["algbw"], cell["busbw"], cell["wrong"])
            if verbose:
                line += _EXTRA % (format_time(cell["p50_us"]), format_time(cell["p99_us"]))
        lines.append(line)
    for why, halves in missing.items():
        lines.append("# N/A (%s): %s" % (" and ".join(sorted(set(halves))), why))
    lines.append("# Wrong elements: %d %s" % (wrong, "OK" if wrong == 0 else "FAILED"))
    return lines


def print_table(result, op, verbose=False):
    print("\n".join(table_lines(result, op, verbose)), flush=True)


def summary_half(op, half=None):
    return half or PREFERRED_HALF.get(op, "out_of_place")


NOISY = 2.0  # p90 over the median beyond which a figure is marked: a tenth of the iterations were slowed that much


def summary(results, ops, half=None):
    """Per op and size: every backend's busbw (the half that summary_half picks), shmcomm's ratio to it (and to the
    faster MPI where both ran), and the memcpy bandwidth at the same nominal size."""
    copies = {row["nominal"]: row["out_of_place"] for row in results.get("memcpy", {}).get("rows", [])}
    entries = []
    for op in ops:
        chosen = summary_half(op, half)
        by_size = {}
        for name, result in results.items():
            if name == "memcpy":
                continue
            for row in result["rows"]:
                if row["op"] == op:
                    entry = by_size.setdefault(row["nominal"], {"op": op, "half": chosen, "nominal": row["nominal"],
                                                                "size": row["size"], "busbw": {}, "ratio": {},
                                                                "noisy": []})
                    entry["busbw"][name] = row[chosen].get("busbw")
                    if row[chosen].get("p90_us", 0) > NOISY * row[chosen].get("p50_us", float("inf")):
                        entry["noisy"].append(name)
        for nominal in sorted(by_size):
            entry = by_size[nominal]
            ours = entry["busbw"].get("shmcomm")
            for name, theirs in entry["busbw"].items():
                if name != "shmcomm":
                    entry["ratio"][name] = ours / theirs if ours is not None and theirs else None
            mpis = [entry["busbw"][n] for n in MPI_NAMES if entry["busbw"].get(n)]
            if len(mpis) > 1:
                entry["ratio"][FASTER_MPI] = ours / max(mpis) if ours is not None else None
            copy = copies.get(nominal, {})
            entry["memcpy"] = copy.get("busbw")
            entries.append(entry)
    return entries


def _bandwidth(value, width):
    """Two decimals as nccl-tests prints, but small messages keep three significant digits so they still compare."""
    if value is None:
        return "%*s" % (width, "N/A")
    if value >= 1 or value == 0:
        return "%*.2f" % (width, value)
    return "%*.*f" % (width, min(6, 2 - int(math.floor(math.log10(value)))), value)


def _ratio(value, width):
    return "%*s" % (width, "-") if value is None else "%*.2f" % (width, value)


def _halves_text(entries):
    by_half = {}
    for entry in entries:
        ops = by_half.setdefault(entry["half"], [])
        if entry["op"] not in ops:
            ops.append(entry["op"])
    return "; ".join("%s for %s" % (HALF_NAMES[half], ", ".join(ops)) for half, ops in by_half.items())


def summary_lines(entries, names, machine, command, date, notes=()):
    """The side-by-side table: each backend's busbw followed by shmcomm's ratio to it, then memcpy."""
    columns = []  # (header, width, value of an entry)
    for name in names:
        if name == "memcpy":
            continue
        columns.append((name, 10, lambda e, n=name: _bandwidth(e["busbw"].get(n), 10)))
        if name != "shmcomm" and "shmcomm" in names:
            label = "shmcomm/%s" % name
            width = len(label) + 2
            columns.append((label, width, lambda e, n=name, w=width: _ratio(e["ratio"].get(n), w)))
    if "shmcomm" in names and sum(n in names for n in MPI_NAMES) > 1:
        label = "shmcomm/%s" % FASTER_MPI
        columns.append((label, len(label) + 2, lambda e, w=len(label) + 2: _ratio(e["ratio"].get(FASTER_MPI), w)))
    if "memcpy" in names:
        columns.append(("memcpy", 10, lambda e: _bandwidth(e["memcpy"], 10)))
    lines = ["#",
             "# Summary: busbw in GB/s from the median times (%s)." % _halves_text(entries),
             "# shmcomm/X is shmcomm's busbw over X's: above 1.00 shmcomm is faster. memcpy is one process copying "
             "a buffer of that size.",
             "#",
             "#  %-13s %12s" % ("op", "size") + "".join("%*s" % (width, head) for head, width, _ in columns)]
    for entry in entries:
        noisy = [name for name in entry.get("noisy", ()) if name in names]
        lines.append("   %-13s %12d" % (entry["op"], entry["size"]) + "".join(cell(entry) for _, _, cell in columns)
                     + ("  noisy: %s" % ", ".join(noisy) if noisy else ""))
    lines.append("#")
    if any(entry.get("noisy") for entry in entries):
        lines.append("# noisy: a tenth of that backend's iterations took over %g times its median: the machine was "
                     "busy, so the ratio is uncertain; rerun, or compare in one job (benchmarks.interleaved)" % NOISY)
    lines.append("# memcpy of %d MiB: one process %.2f GB/s; two processes at once %.2f GB/s in total" % (
        machine["memcpy_bytes"] >> 20, machine["memcpy_one_process_GBps"], machine["memcpy_two_processes_GBps"]))
    lines += ["# %s" % note for note in notes]
    lines.append("# %s | %s | %s" % (command, date, machine["line"]))
    return lines


def print_summary(entries, names, machine, command, date, notes=()):
    print("\n".join(summary_lines(entries, names, machine, command, date, notes)), flush=True)


def ideal_copies(op, size, n):
    """Bytes an ideal shared-memory algorithm must copy, over all ranks, for one call of `op` at the `size` column
    (nccl-tests' meaning) on n ranks, with each rank's own block already where it belongs: every byte that must
    reach another rank is copied once; a reduction reads each rank's block of every input and writes the reduced
    block, which counts as half a copy per byte read or written."""
    if op in ("broadcast", "allgather", "alltoall"):  # (n-1)/n of the output of n ranks, or S to n-1 ranks
        return (n - 1) * size
    if op == "reducescatter":  # per rank: read n blocks of S/n, write one
        return (n + 1) * size // 2
    if op == "allreduce":  # a reduce-scatter, then each rank copies the n-1 reduced blocks it lacks
        return (n + 1) * size // 2 + (n - 1) * size
    raise ValueError(op)


def memory_limit_lines(results, ops, machine, half=None, at=64 << 20):
    """For each op at `at` bytes (or the largest size measured), shmcomm's time against the memory system's limit:
    ideal_copies at the rate two processes copying at once reach together (the memcpy reference). The fraction says
    how much of the limit is reached; above 1, the call beat the reference copy (the kernel's copy for single-copy
    paths, or caches, can)."""
    result = results.get("shmcomm")
    if not result:
        return []
    n = result["nranks"]
    bytes_per_s = machine["memcpy_two_processes_GBps"] * 1e9
    lines = ["#", "# Memory limit: the bytes an ideal algorithm copies (own blocks in place), at %.2f GB/s (memcpy "
             "by two processes at once):" % (bytes_per_s / 1e9),
             "#  %-13s %12s %12s %12s %12s %9s" % ("op", "size", "copied MB", "limit us", "shmcomm us", "fraction")]
    for op in ops:
        rows = [row for row in result["rows"] if row["op"] == op]
        picked = [row for row in rows if row["nominal"] == at] or sorted(rows, key=lambda row: row["nominal"])[-1:]
        for row in picked:
            measured = row[summary_half(op, half)].get("time_us")
            copied = ideal_copies(op, row["size"], n)
            limit_us = copied / bytes_per_s * 1e6
            lines.append("   %-13s %12d %12.3f %12.4g %12s %9s" % (
                op, row["size"], copied / 1e6, limit_us, "%.4g" % measured if measured else "N/A",
                "%.2f" % (limit_us / measured) if measured else "-"))
    return lines


def _read_field(path, key):
    try:
        with open(path) as info:
            for line in info:
                if line.split(":")[0].strip() == key:
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def machine(reference):
    """Cores this process may run on, CPU model, memory, and the measured copy bandwidths."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    cpu = _read_field("/proc/cpuinfo", "model name") or platform.processor() or "unknown CPU"
    mem_kb = _read_field("/proc/meminfo", "MemTotal")
    memory = int(mem_kb.split()[0]) * 1024 if mem_kb else None
    one, two = reference["one_process_Bps"] / 1e9, reference["two_processes_Bps"] / 1e9
    line = "machine: %d cores, %s, %s memory, memcpy %d MiB %.2f GB/s on one core, %.2f GB/s on two" % (
        cores, cpu, "%.1f GiB" % (memory / 2.0 ** 30) if memory else "unknown", reference["bytes"] >> 20, one, two)
    return {"cores": cores, "cpu": cpu, "memory_bytes": memory, "memcpy_bytes": reference["bytes"],
            "memcpy_one_process_GBps": one, "memcpy_two_processes_GBps": two, "python": platform.python_version(),
            "line": line}


def write_json(path, document):
    with open(path, "w") as out:
        json.dump(document, out, indent=1)
        out.write("\n")


def plot(path, results, ops, half=None):
    """busbw against size (log2 axis) and time against size (log-log), one line per backend, a row per op."""
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only; no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        print("benchmarks.collectives: --plot needs matplotlib: pip install matplotlib", file=sys.stderr)
        return 1
    fig, axes = plt.subplots(len(ops), 2, figsize=(12, 3.4 * len(ops)), squeeze=False)
    for (bw_ax, time_ax), op in zip(axes, ops):
        chosen = summary_half(op, half)
        for name, result in results.items():
            rows = [r for r in result["rows"] if r["op"] == ("copy" if name == "memcpy" else op)]
            points = [(r["size"], r[chosen if name != "memcpy" else "out_of_place"]) for r in rows]
            points = [(size, cell) for size, cell in points if "na" not in cell]
            if not points:
                continue
            style = {"linestyle": "--", "color": "grey"} if name == "memcpy" else {"marker": "o", "markersize": 3}
            sizes = [size for size, _ in points]
            bw_ax.plot(sizes, [cell["busbw"] for _, cell in points], label=name, **style)
            if name != "memcpy":
                time_ax.plot(sizes, [cell["time_us"] for _, cell in points], label=name, **style)
        bw_ax.set_xscale("log", base=2)
        bw_ax.set(title="%s busbw (%s)" % (op, HALF_NAMES[chosen]), xlabel="size (B)", ylabel="GB/s")
        time_ax.set_xscale("log")
        time_ax.set_yscale("log")
        time_ax.set(title="%s time (%s, median)" % (op, HALF_NAMES[chosen]), xlabel="size (B)", ylabel="us")
        for ax in (bw_ax, time_ax):
            ax.grid(True, which="both", alpha=0.3)
            ax.legend(fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return 0

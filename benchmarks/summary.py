# SPDX-License-Identifier: Apache-2.0
"""The summary of benchmarks/RESULTS.md from runs of benchmarks.collectives: per collective, one Markdown table
and one plot of every backend, each run (an idle machine, a busy one) side by side.

    python -m benchmarks.summary benchmarks/results/np2_idle.json benchmarks/results/np2_busy.json \\
        --labels idle,busy --plots benchmarks/results > table.md

Each table row gives, per run, shmcomm's median and p90 time, the fastest peer's (MPICH, Open MPI, gloo, and oneCCL
and DeepSpeed's op where they ran; memcpy is no peer) and the peer's median over shmcomm's: above 1.00 shmcomm is
faster. Each run's command, date and machine follow the tables, as the JSON recorded them.
"""
import argparse
import json
import os
import sys

from benchmarks import report

PEERS = ("mpi", "openmpi", "gloo", "oneccl", "deepspeed")
PEER_NAMES = {"mpi": "MPICH", "openmpi": "Open MPI", "gloo": "gloo", "oneccl": "oneCCL", "deepspeed": "DeepSpeed"}


def _cell(result, op, nominal):
    """(median us, p90 us) of the half the summary compares, or None where the backend has no such row."""
    half = report.summary_half(op)
    for row in result["rows"]:
        if row["op"] == op and row["nominal"] == nominal and "time_us" in row[half]:
            return row[half].get("p50_us", row[half]["time_us"]), row[half].get("p90_us")
    return None


def _us(value):
    return "-" if value is None else report.format_time(value).strip()


def _size(nominal):
    for unit, shift in (("G", 30), ("M", 20), ("K", 10)):
        if nominal >= 1 << shift and nominal % (1 << shift) == 0:
            return "%d %siB" % (nominal >> shift, unit)
    return "%d B" % nominal


def op_table(runs, labels, op):
    """The Markdown lines of one collective's table."""
    head = ["size"]
    for label in labels:
        head += ["%s: shmcomm us (p90)" % label, "%s: fastest peer us (p90)" % label, "%s: peer/shmcomm" % label]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    nominals = sorted({row["nominal"] for run in runs for row in run["results"]["shmcomm"]["rows"]
                       if row["op"] == op})
    for nominal in nominals:
        cells = [_size(nominal)]
        for run in runs:
            ours = _cell(run["results"]["shmcomm"], op, nominal)
            peers = [(name, _cell(run["results"][name], op, nominal)) for name in PEERS if name in run["results"]]
            peers = [(name, cell) for name, cell in peers if cell]
            if not ours or not peers:
                cells += ["-", "-", "-"]
                continue
            name, best = min(peers, key=lambda peer: peer[1][0])
            cells += ["%s (%s)" % (_us(ours[0]), _us(ours[1])),
                      "%s %s (%s)" % (PEER_NAMES[name], _us(best[0]), _us(best[1])),
                      "**%.2f**" % (best[0] / ours[0])]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def plot(path, runs, labels, op):
    """busbw against size, a line per backend and run (solid for the first run, dashed for the next)."""
    import matplotlib
    matplotlib.use("Agg")  # files only; no display needed
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    colours = {"shmcomm": "tab:red", "mpi": "tab:blue", "openmpi": "tab:green", "gloo": "tab:orange",
               "oneccl": "tab:purple", "deepspeed": "tab:brown"}
    half = report.summary_half(op)
    for run, label, style in zip(runs, labels, ("-", "--", ":", "-.")):
        for name in ("shmcomm",) + PEERS:
            if name not in run["results"]:
                continue
            rows = [r for r in run["results"][name]["rows"] if r["op"] == op and "busbw" in r[half]]
            if rows:
                ax.plot([r["size"] for r in rows], [r[half]["busbw"] for r in rows], style, marker="o", markersize=3,
                        color=colours[name], label="%s, %s" % (PEER_NAMES.get(name, name), label))
    ax.set_xscale("log", base=2)
    ax.set(title="%s, %d ranks (%s)" % (op, runs[0]["results"]["shmcomm"]["nranks"], report.HALF_NAMES[half]),
           xlabel="size (B)", ylabel="busbw (GB/s)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize="x-small", ncol=2)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m benchmarks.summary", description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", metavar="RUN.json", help="benchmarks.collectives --json files")
    parser.add_argument("--labels", help="a comma-separated name per run (default: run1, run2, ...)")
    parser.add_argument("--plots", metavar="DIR", help="write DIR/<op>_np<N>.png per collective (needs matplotlib)")
    options = parser.parse_args(argv)
    runs = []
    for path in options.runs:
        with open(path) as f:
            runs.append(json.load(f))
    labels = options.labels.split(",") if options.labels else ["run%d" % (i + 1) for i in range(len(runs))]
    if len(labels) != len(runs):
        parser.error("--labels needs one name per run")
    ops = [op for op in runs[0]["options"]["ops"] if all(op in r["options"]["ops"] for r in runs)]
    out = []
    for op in ops:
        out += ["", "### %s" % op, ""] + op_table(runs, labels, op)
        if options.plots:
            name = "%s_np%d.png" % (op, runs[0]["results"]["shmcomm"]["nranks"])
            plot(os.path.join(options.plots, name), runs, labels, op)
            out += ["", "![%s](results/%s)" % (op, name)]
    out.append("")
    for run, label in zip(runs, labels):
        out.append("- %s: `%s`, %s, %s%s" % (label, run["command"], run["date"], run["machine"]["line"],
                                              "".join("; " + note for note in run["notes"])))
    print("\n".join(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""Draws docs/benchmarks.md's plots from the CSVs `edgemeta-bench` writes in one run.

  bench_plots.py --p2 P2.csv --devices DEVICES.csv --burst BURST.csv --out docs

--p2 comes from `edgemeta-bench --csv`, --devices from `--devices-csv`, --burst from
`--burst-csv`. Each plot is drawn only if its CSV was given and holds data; the files are
benchmarks-p2.png, benchmarks-devices.png and benchmarks-burst.png in --out.
"""

import argparse
import csv
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

SYSTEMS = (("edgemeta", "C0", "-"), ("mosquitto", "C1", "--"))


def rows_of(path):
    if not path or not os.path.exists(path):
        return []
    with open(path) as f:
        return list(csv.DictReader(f))


def p2(rows, out):
    fig, (rate_ax, lat_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for system, style in (("edgemeta", "-o"), ("mosquitto", "--s")):
        pts = [r for r in rows if r["system"] == system]
        x = [int(r["offered"]) for r in pts]
        rate_ax.plot(x, [float(r["delivered"]) for r in pts], style, label=system)
        for q, alpha in (("p50_us", 1.0), ("p99_us", 0.6)):
            lat_ax.plot(x, [int(r[q]) / 1000 for r in pts], style, alpha=alpha, label=f"{system} {q[:-3]}")
    top = max(int(r["offered"]) for r in rows)
    rate_ax.plot([0, top], [0, top], ":", color="grey", label="offered")
    rate_ax.set_xlabel("offered load (msg/s)")
    rate_ax.set_ylabel("delivered (msg/s)")
    rate_ax.set_title("P2: delivered against offered")
    lat_ax.set_xlabel("offered load (msg/s)")
    lat_ax.set_ylabel("publish → subscriber latency (ms)")
    lat_ax.set_title("P2: latency against offered")
    lat_ax.set_yscale("log")
    for ax in (rate_ax, lat_ax):
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def devices(rows, out):
    fig, (rss_ax, cpu_ax, lat_ax) = plt.subplots(1, 3, figsize=(14, 4))
    for system, color, line in SYSTEMS:
        pts = [r for r in rows if r["system"] == system]
        t = [int(r["t_s"]) for r in pts]
        rss_ax.plot(t, [float(r["rss_mb"]) for r in pts], line, color=color, marker="o", label=system)
        broker = [float(r["cpu_us_per_report"]) for r in pts]
        helper = [float(r["responder_cpu_us_per_report"]) for r in pts]
        if any(helper):
            cpu_ax.plot(t, [b + h for b, h in zip(broker, helper)], line, color=color, marker="o",
                        label=f"{system} + responder")
            cpu_ax.plot(t, broker, ":", color=color, label=f"{system} alone")
        else:
            cpu_ax.plot(t, broker, line, color=color, marker="o", label=system)
        for q, alpha in (("p50_us", 1.0), ("p99_us", 0.5)):
            lat_ax.plot(t, [int(r[q]) / 1000 for r in pts], line, color=color, alpha=alpha, marker="o",
                        label=f"{system} {q[:-3]}")
    rss_ax.set_ylabel("RSS (MB)")
    rss_ax.set_title("Devices: memory over the run")
    rss_ax.set_ylim(bottom=0)
    cpu_ax.set_ylabel("CPU µs per report")
    cpu_ax.set_title("Devices: CPU per report, per interval")
    cpu_ax.set_ylim(bottom=0)
    lat_ax.set_ylabel("report → result latency (ms)")
    lat_ax.set_title("Devices: latency of the interval's reports")
    lat_ax.set_yscale("log")
    for ax in (rss_ax, cpu_ax, lat_ax):
        ax.set_xlabel("seconds into the load")
        ax.grid(True, alpha=0.3, which="both")
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def burst(rows, out):
    fig, (got_ax, rss_ax) = plt.subplots(1, 2, figsize=(11, 4))
    for system, color, line in SYSTEMS:
        pts = [r for r in rows if r["system"] == system]
        for run in sorted({int(r["run"]) for r in pts}):
            course = [r for r in pts if int(r["run"]) == run]
            t = [int(r["t_ms"]) / 1000 for r in course]
            label = system if run == 0 else None
            got_ax.plot(t, [int(r["qos1_received"]) for r in course], line, color=color, alpha=0.6,
                        label=label)
            rss_ax.plot(t, [float(r["rss_mb"]) for r in course], line, color=color, alpha=0.6,
                        label=label)
    got_ax.set_ylabel("messages the QoS 1 reader has")
    got_ax.set_title("B1 burst: delivered, every run")
    rss_ax.set_ylabel("RSS (MB)")
    rss_ax.set_title("B1 burst: memory, every run")
    rss_ax.set_ylim(bottom=0)
    for ax in (got_ax, rss_ax):
        ax.set_xlabel("seconds into the burst")
        ax.set_xlim(left=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--p2", help="edgemeta-bench --csv output")
    parser.add_argument("--devices", help="edgemeta-bench --devices-csv output")
    parser.add_argument("--burst", help="edgemeta-bench --burst-csv output")
    parser.add_argument("--out", default="docs", help="directory for the PNGs (default: docs)")
    args = parser.parse_args()
    drawn = 0
    for name, path, draw in (("p2", args.p2, p2), ("devices", args.devices, devices), ("burst", args.burst, burst)):
        rows = rows_of(path)
        if not rows:
            continue
        out = os.path.join(args.out, f"benchmarks-{name}.png")
        draw(rows, out)
        print(f"{out} updated")
        drawn += 1
    if drawn == 0:
        print("bench_plots.py: no CSV with data given, nothing drawn")


if __name__ == "__main__":
    main()

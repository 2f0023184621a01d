"""Summarise Nsight Compute raw-page CSVs (`ncu --import X.ncu-rep --page raw --csv`): one block per profiled
kernel launch with its time, registers, occupancy (achieved / theoretical and the limiting resource), DRAM and L2
traffic, issue activity and the five largest warp stall reasons (cycles per issued instruction).

    python benchmarks/ncu_summary.py OUTDIR/*.raw.csv
"""

from __future__ import annotations

import csv
import os

FIELDS = [  # (label, metric, scale)
    ("time us", "gpu__time_duration.sum", 1e-3),
    ("grid", "launch__grid_size", 1),
    ("block", "launch__block_size", 1),
    ("regs", "launch__registers_per_thread", 1),
    ("smem/blk B", "launch__shared_mem_per_block", 1),
    ("occ theor %", "sm__maximum_warps_per_active_cycle_pct", 1),
    ("occ achieved %", "sm__warps_active.avg.pct_of_peak_sustained_active", 1),
    ("limit regs (blocks)", "launch__occupancy_limit_registers", 1),
    ("limit smem (blocks)", "launch__occupancy_limit_shared_mem", 1),
    ("limit warps (blocks)", "launch__occupancy_limit_warps", 1),
    ("waves", "launch__waves_per_multiprocessor", 1),
    ("dram %", "gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("dram read MB", "dram__bytes_read.sum", 1e-6),
    ("dram write MB", "dram__bytes_write.sum", 1e-6),
    ("L2 hit %", "lts__t_sector_hit_rate.pct", 1),
    ("L1 hit %", "l1tex__t_sector_hit_rate.pct", 1),
    ("SM busy %", "sm__throughput.avg.pct_of_peak_sustained_elapsed", 1),
    ("issue active %", "smsp__issue_active.avg.pct_of_peak_sustained_active", 1),
    ("cycles/issue", "smsp__average_warp_latency_per_inst_issued.ratio", 1),
    ("instructions M", "smsp__inst_executed.sum", 1e-6),
]


def number(text):
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def summarise(path):
    with open(path, newline="") as f:
        rows = list(csv.reader(f))
    start = next((i for i, row in enumerate(rows) if "Kernel Name" in row), None)
    if start is None:
        return [f"== {os.path.basename(path)}: no kernel rows"]
    header, data = rows[start], [row for row in rows[start + 2:] if len(row) == len(rows[start])]
    col = {name: i for i, name in enumerate(header)}
    lines = []
    for row in data:
        lines.append(f"== {os.path.basename(path).removesuffix('.raw.csv')}  {row[col['Kernel Name']][:40]}  "
                     f"id {row[col['ID']]}")
        parts = []
        for label, metric, scale in FIELDS:
            value = number(row[col[metric]]) if metric in col else None
            if value is not None:
                parts.append(f"{label} {value * scale:.4g}")
        lines.append("   " + " | ".join(parts))
        stalls = []
        for name, i in col.items():
            if "issue_stalled" in name and name.endswith("per_issue_active.ratio") and "not_issued" not in name:
                value = number(row[i])
                if value:
                    reason = name.split("issue_stalled_")[1].removesuffix("_per_issue_active.ratio")
                    stalls.append((value, reason))
        stalls.sort(reverse=True)
        lines.append("   stalls (cycles per issue): " + ", ".join(f"{r} {v:.2f}" for v, r in stalls[:6]))
    return lines


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv", nargs="*", help="ncu --csv --page raw exports")
    for path in parser.parse_args().csv:
        print("\n".join(summarise(path)))

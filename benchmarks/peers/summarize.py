"""Print a markdown table of peer runs: every benchmarks/.cache/runs/*/result.json (or given dirs).

    python benchmarks/peers/summarize.py [RUN_DIR ...]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def main() -> None:
    dirs = [Path(a) for a in sys.argv[1:]] or sorted((ROOT / "benchmarks/.cache/runs").glob("*"))
    print("| run | tool | method | calib | quantize wall s | quantize cpu s | total wall s | peak RSS MiB | load avg | grid (max distinct/64) |")
    print("| --- | --- | --- | --- | ---: | ---: | ---: | ---: | ---: | --- |")
    for d in dirs:
        f = d / "result.json"
        if not f.exists():
            continue
        r = json.loads(f.read_text())
        c = r["calib"]
        g = r["grid_check"]
        cpu = r.get("cpu_s", {}).get("quantize_call", "–")
        la = r.get("load_avg_at_end")
        print(f"| {d.name} | {r['tool']} {r['tool_version']} | {r['method']} | {c['samples']}x{c['seq_len']} "
              f"| {r['wall_s']['quantize_call']:.0f} | {cpu if cpu == '–' else f'{cpu:.0f}'} "
              f"| {r['wall_s']['total']:.0f} | {r['ru_maxrss_mib']:.0f} | {'–' if la is None else f'{la[0]:.1f}'} "
              f"| {'ok' if g['grid_ok'] else 'FAIL'} ({g['max_distinct_per_group']}) |")


if __name__ == "__main__":
    main()

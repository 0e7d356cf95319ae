"""Merges the JSON lines of sparsecar_cuda_bench and torch_gpu_baseline.py into one JSON list
and prints it as a table (one row per kernel, sizes x densities as columns of ms and the ratio
to the device copy measured in the same run).

Usage: python3 report.py RAW.jsonl OUT.json
"""
import json
import sys


def main():
    if len(sys.argv) != 3:
        sys.exit("usage: report.py RAW.jsonl OUT.json")
    rows = []
    with open(sys.argv[1], encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            row = json.loads(line)
            missing = {"kernel", "elements", "density", "ms", "gbps", "ratio_to_copy", "card"} - row.keys()
            if missing:
                sys.exit(f"report.py: line {number} lacks {sorted(missing)}")
            rows.append(row)
    if not rows:
        sys.exit("report.py: no rows")
    with open(sys.argv[2], "w", encoding="utf-8") as f:
        json.dump(rows, f, indent=1)
        f.write("\n")
    cards = sorted({r["card"] for r in rows})
    print("cards: " + "; ".join(cards))
    grid = sorted({(r["elements"], r["density"]) for r in rows})
    names = list(dict.fromkeys(r["kernel"] for r in rows))
    head = " | ".join(f"{n / 1048576:g}M @{d * 100:g}% ms (x copy BW)" for n, d in grid)
    print(f"| kernel | {head} |")
    print("| --- |" + " --- |" * len(grid))
    at = {(r["kernel"], r["elements"], r["density"]): r for r in rows}
    for name in names:
        cells = []
        for n, d in grid:
            r = at.get((name, n, d))
            cells.append(f"{r['ms']:.3f} ({r['ratio_to_copy']:.2f})" if r else "")
        print(f"| {name} | " + " | ".join(cells) + " |")
    print(f"wrote {sys.argv[2]} ({len(rows)} rows)")


if __name__ == "__main__":
    main()

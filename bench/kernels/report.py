"""Turns Google Benchmark JSON from sparsecar_kernels_bench into bench-kernels.json rows
{"kernel", "elements", "density", "gbps", "ratio_to_memcpy", "threads"} and prints them as a
table (threads: 1, or the pool size of the *_threads cases; the ratio is always to a
single-threaded memcpy).
Usage: report.py RAW_JSON OUT_JSON"""
import json
import platform
import sys

raw_path, out_path = sys.argv[1], sys.argv[2]
raw = json.load(open(raw_path))

# Medians when there are repetitions, the single run otherwise.
runs = {}
for b in raw["benchmarks"]:
    if b.get("error_occurred"):
        continue
    name = b.get("run_name", b["name"])
    if b.get("run_type") == "aggregate" and b.get("aggregate_name") != "median":
        continue
    if b.get("run_type") == "iteration" and name in runs:
        continue  # keep the first iteration run if no aggregate comes
    if b.get("run_type") == "aggregate" or name not in runs:
        runs[name] = b

memcpy = {}
rows = []
for name, b in runs.items():
    parts = name.split("/")
    kernel = parts[0].removeprefix("BM_")
    elements = int(parts[1])
    density = int(parts[2]) / 1000.0
    threads = 1
    if kernel.endswith("_threads"):
        kernel = kernel.removesuffix("_threads")
        threads = int(parts[3].split(":")[0])
    gbps = b["bytes_per_second"] / 1e9
    if kernel == "memcpy":
        memcpy[elements] = gbps
        continue
    rows.append({"kernel": kernel, "elements": elements, "density": density, "gbps": round(gbps, 3),
                 "threads": threads})
for r in rows:
    m = memcpy.get(r["elements"])
    r["ratio_to_memcpy"] = round(r["gbps"] / m, 3) if m else None

order = ["ef_threshold", "topk_exact", "topk_approx", "nth_element", "coo_encode", "coo_decode",
         "bitmap_encode", "bitmap_decode", "coo_varint_decode", "rle_decode"]
rows.sort(key=lambda r: (order.index(r["kernel"]) if r["kernel"] in order else len(order), r["kernel"],
                         r["threads"], r["elements"], r["density"]))
with open(out_path, "w") as f:
    json.dump(rows, f, indent=1)
    f.write("\n")

def size(n):
    return f"{n >> 20}M" if n % (1 << 20) == 0 else str(n)

ctx = raw.get("context", {})
print(f"machine: {platform.node()} {ctx.get('num_cpus')} CPUs @ {ctx.get('mhz_per_cpu')} MHz, "
      f"load {ctx.get('load_avg')}; memcpy GB/s: " +
      ", ".join(f"{size(n)} {g:.1f}" for n, g in sorted(memcpy.items())))
print("| kernel | threads | elements | density | GB/s | ratio to memcpy |")
print("| --- | ---: | ---: | ---: | ---: | ---: |")
for r in rows:
    ratio = "n/a" if r["ratio_to_memcpy"] is None else f"{r['ratio_to_memcpy']:.2f}"
    print(f"| {r['kernel']} | {r['threads']} | {size(r['elements'])} | {r['density'] * 100:g} % | "
          f"{r['gbps']:.2f} | {ratio} |")
print(f"wrote {out_path} ({len(rows)} rows)")

"""Run every benchmark, one after another, and print a summary of the ratios.

    .venv/bin/python bench/run_all.py        (or: make bench)

Each benchmark also leaves its full figures in bench/results/NAME.json.
Run on an otherwise idle machine: the floors are measured in the same run,
but two cores shared with other work make every figure noisy.
"""

import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BENCHMARKS = [
    "bench_start", "bench_bash", "bench_relay", "bench_memory", "bench_cgroups", "bench_storage",
]


def main() -> int:
    failed = []
    for name in BENCHMARKS:
        print(f"== {name}", flush=True)
        if subprocess.run([sys.executable, "-m", f"bench.{name}", *sys.argv[1:]], cwd=REPO).returncode:
            failed.append(name)
    print("== summary")
    for name in ("start", "bash", "relay", "memory", "cgroups", "storage"):
        path = os.path.join(REPO, "bench", "results", f"{name}.json")
        if os.path.exists(path):
            with open(path) as f:
                result = json.load(f)
            for key, value in result.get("results", {"": result}).items():
                figures = {k: v for k, v in value.items() if not isinstance(v, (dict, list))}
                print(f"{name:7} {key:8} {figures}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

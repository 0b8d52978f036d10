"""What the benchmarks share: percentiles, process memory, result records."""

import json
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if REPO not in sys.path:
    sys.path.insert(0, REPO)

from supervisor import proctree  # noqa: E402
from tests.support import RunningSupervisor, rss_kib  # noqa: E402,F401

RESULTS_DIR = os.path.join(REPO, "bench", "results")


def percentile(samples: list[float], fraction: float) -> float:
    """The ``fraction`` quantile (0.5 = median) of ``samples``."""
    ordered = sorted(samples)
    index = min(len(ordered) - 1, max(0, round(fraction * (len(ordered) - 1))))
    return ordered[index]


def timed(function, count: int) -> list[float]:
    """Run ``function`` ``count`` times; return each duration in milliseconds."""
    samples = []
    for _ in range(count):
        start = time.perf_counter()
        function()
        samples.append((time.perf_counter() - start) * 1000)
    return samples


def summary(samples: list[float]) -> dict:
    """p50, p90 and the count of a list of millisecond samples."""
    return {
        "p50_ms": round(percentile(samples, 0.5), 3),
        "p90_ms": round(percentile(samples, 0.9), 3),
        "mean_ms": round(statistics.fmean(samples), 3),
        "n": len(samples),
    }


def uss_kib(pid: int) -> int:
    """Unique set size (private clean + dirty) of ``pid`` in KiB."""
    total = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                total += int(line.split()[1])
    return total


def tree_uss_kib(pid: int) -> int:
    """USS of ``pid`` and every descendant, in KiB."""
    return sum(uss_kib(p) for p in [pid, *proctree.descendants(pid)] if proctree.alive(p))


def isolations() -> list[str]:
    """The isolation strategies to measure: from argv, else both real ones as root."""
    chosen = []
    arguments = sys.argv[1:]
    for i, argument in enumerate(arguments):
        if not argument.startswith("-") and not (i and arguments[i - 1].startswith("--")):
            chosen.append(argument)
    if chosen:
        return chosen
    return ["setpriv", "bwrap"] if os.geteuid() == 0 else ["none"]


def record(name: str, result: dict) -> dict:
    """Print ``result`` and save it as bench/results/NAME.json."""
    os.makedirs(RESULTS_DIR, exist_ok=True)
    result = {"benchmark": name, "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), **result}
    with open(os.path.join(RESULTS_DIR, f"{name}.json"), "w") as f:
        json.dump(result, f, indent=2)
    print(json.dumps(result, indent=2))
    return result


def isolated_floor_spec(supervisor, isolation: str, reply: dict, name: str, source: str,
                        args: tuple[str, ...]):
    """The SpawnSpec that runs the script ``source`` under ``isolation`` as a runner would be.

    Same uid, namespaces, sandbox, environment and working directory as the
    conversation in ``reply``: the floors of the start and bash benchmarks.
    """
    from supervisor.config import load_config
    from supervisor.plugins import PluginRegistry
    from supervisor.spawn import RunnerLaunch, runner_env

    directory = os.path.join(supervisor.state_dir, "bench-floor")
    os.makedirs(directory, exist_ok=True)
    os.chmod(directory, 0o755)
    script = os.path.join(directory, name)
    with open(script, "w") as f:
        f.write(source)
    os.chmod(script, 0o644)
    config = load_config(environ={"CORRAL_STATE_DIR": supervisor.state_dir})
    strategy = PluginRegistry().build("isolation", isolation, config)
    launch = RunnerLaunch(
        owner=reply["owner"], conversation=reply["conversation"], uid=reply["uid"],
        gid=reply["uid"], workspace=reply["workspace"], python=config.runner_python,
        runner_script=script, runner_args=args, env=runner_env(reply["workspace"]),
    )
    return strategy.spawn_spec(launch)


def compare(ours: list[float], floor: list[float], target: float) -> dict:
    """corral's samples against the floor's: both summaries, p50 and p90 ratios, the target."""
    ours_summary, floor_summary = summary(ours), summary(floor)
    return {
        "corral": ours_summary,
        "floor": floor_summary,
        "ratio_p50": round(ours_summary["p50_ms"] / floor_summary["p50_ms"], 3),
        "ratio_p90": round(ours_summary["p90_ms"] / floor_summary["p90_ms"], 3),
        "target_ratio_p50": target,
    }

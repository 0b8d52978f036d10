"""corral's benchmarks: each compares a figure with a floor measured in the same run."""

"""rksc_bench and the scripts in benchmarks/."""

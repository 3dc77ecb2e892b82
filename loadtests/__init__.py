"""Load generation and side-by-side serving benchmarks (see loadtests/README.md)."""

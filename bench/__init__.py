"""Side-by-side benchmarks; `make bench` runs them all and rewrites RESULTS.md."""

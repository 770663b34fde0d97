"""Product tools off the request path: the probe, the benchmarks, the course exercises."""

"""Benchmarks: the batching study (throughput), serving latency, peers."""

"""Benchmark figures: timers, the in-flight tracker, per-GPU formulas, the roofline, the NVML sampler."""

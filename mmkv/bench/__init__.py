"""Benchmarks: synthetic codec protocol and GPU kernels."""

"""Benchmark workloads, runner and reports (see DESIGN §7)."""

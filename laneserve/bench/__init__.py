"""Benchmark support: metrics, reports, searches (goodput, SLO scale) and result files."""

"""Baselines in the same harness: synchronous data parallel on Ray Train."""

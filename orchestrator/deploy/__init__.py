"""Clusters and Jobs: checks of cluster.yaml against a config, and the Ray Jobs client behind `diloco submit` / `status`."""

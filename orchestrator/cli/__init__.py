"""The `diloco` command line: one module per command group. Environment variables are read here and nowhere else."""

from orchestrator.cli.main import main

__all__ = ["main"]

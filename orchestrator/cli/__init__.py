"""The `diloco` command line: one module per command group. Environment variables are read here and nowhere else.

The entry point is `orchestrator.cli.main:main` (the `diloco` console script; `python -m orchestrator.cli` runs it
too). This __init__ imports nothing, so the command modules never import the package that gathers them.
"""

"""Worked examples that live outside the packages, as a user's code would (docs/extending.md)."""

"""Prefect flows (the BCD run, one flow run per visit, the full-parameter baseline) and the CLI."""

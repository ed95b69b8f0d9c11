"""Prefect tasks (thin) and the plain functions behind them. Tests call the functions directly."""

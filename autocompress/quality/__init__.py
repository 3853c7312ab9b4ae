"""Evaluation tasks and their data."""

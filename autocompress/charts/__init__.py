"""Figures and plots of a run's results."""

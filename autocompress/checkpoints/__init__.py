"""Checkpoint formats the export writes (DeciLM / Nemotron-NAS files)."""

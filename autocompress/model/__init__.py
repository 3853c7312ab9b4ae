"""The base model, calibration text and loading checkpoints."""

"""Configuration: the typed schema, Hydra composition, command-line parsing, this machine's CPU."""

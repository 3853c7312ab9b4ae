"""Architectures and the search space, masks on the unmodified model, activation importance."""

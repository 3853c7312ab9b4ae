"""One differentiable search, what a sweep prepares once, the Ray cluster its trials run on."""

"""The run folder's tables and their schema, Pareto fronts."""

"""What the search must beat: naive rules and NVIDIA's Minitron."""

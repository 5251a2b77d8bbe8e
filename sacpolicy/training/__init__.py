"""Training: the distilled draft (distill) and, later, the learned policy."""

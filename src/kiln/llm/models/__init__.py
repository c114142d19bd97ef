"""Model definitions (PyTorch forward passes written for kiln's paged attention)."""

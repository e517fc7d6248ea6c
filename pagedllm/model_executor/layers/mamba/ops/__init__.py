"""The ops of the state layers, pure torch (the portable path on every device)."""

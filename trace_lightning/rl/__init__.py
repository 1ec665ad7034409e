"""RL maths as short pure functions: advantages, policy losses, mismatch correction, metrics."""

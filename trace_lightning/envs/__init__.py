"""Verifiable tasks: prompts with ground truth and verifiers returning rewards."""

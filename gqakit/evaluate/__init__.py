"""Evaluation: perplexity (and, later, long-context fluency and passkey retrieval)."""

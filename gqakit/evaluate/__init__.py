"""Evaluation: strided perplexity, long-context fluency (streaming perplexity), passkey retrieval,
and reports (JSON, CSV, PNG)."""

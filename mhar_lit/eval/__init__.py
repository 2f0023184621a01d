"""Evaluation adapters (lm-evaluation-harness). `python -m mhar_lit.eval ...` runs lm_eval's CLI with the
`mhar_lit` model registered; see lm_eval_adapter.py."""

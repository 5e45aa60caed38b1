"""Corpus preparation: raw text/code/JSONL -> Megatron-Core indexed datasets (.bin/.idx).

Entry point: ``python -m data_prep.tokenize_corpus --help`` (or ``python -m data_prep``).
"""

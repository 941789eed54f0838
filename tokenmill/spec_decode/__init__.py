"""Speculative decoding's proposers: n-gram prompt lookup (ngram.py, plain
Python, run by the engine between steps) and a draft model (draft_model.py, run
by the model runner through its `Drafter` protocol, worker/drafter.py)."""

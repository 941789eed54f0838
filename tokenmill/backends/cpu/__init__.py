"""The CPU fast path: C++ kernels (csrc/), the plan that runs a loaded model's
forward and logits on them (plan.py), their paged attention (attention.py) and
the memory they read (memory.py)."""

"""N-gram proposer (prompt lookup, vLLM's method "ngram").

The last n tokens of a request (prompt + output), for n from
prompt_lookup_max down to prompt_lookup_min, are looked for earlier in the
same tokens; at the first (earliest) place the longest such n-gram occurs,
the tokens that followed it are the drafts. Text that is being copied or
lightly edited repeats its prompt, so the drafts are often right; where
nothing matches there are no drafts and the request decodes as usual.
"""

from __future__ import annotations

from collections.abc import Sequence


class NgramProposer:
    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        assert 1 <= prompt_lookup_min <= prompt_lookup_max
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max

    def propose(self, token_ids: Sequence[int], num_tokens: int) -> list[int]:
        """Up to `num_tokens` drafts to follow `token_ids`; [] where no n-gram matches."""
        total = len(token_ids)
        if num_tokens < 1 or total < self.min_n + 1:
            return []
        tokens = list(token_ids)
        for n in range(min(self.max_n, total - 1), self.min_n - 1, -1):
            pattern = tokens[total - n :]
            first = pattern[0]
            # Occurrences starting before the suffix itself, earliest first.
            start = 0
            last_start = total - n - 1
            while start <= last_start:
                try:
                    start = tokens.index(first, start, last_start + 1)
                except ValueError:
                    break
                if tokens[start : start + n] == pattern:
                    follow = start + n
                    return tokens[follow : follow + num_tokens]
                start += 1
        return []

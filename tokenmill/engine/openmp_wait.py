"""OpenMP's wait policy: what a thread does at the end of a parallel region.

libgomp (torch's OpenMP) reads it from the environment once, when torch loads
it, so the entry points (`tokenmill serve`, `tokenmill generate`) set it before
anything imports torch; with torch already loaded it changes nothing. A value
the user set (OMP_WAIT_POLICY or GOMP_SPINCOUNT) is kept unless a policy is
asked for explicitly.

Why it matters: by default an idle libgomp thread spins (300,000 rounds) before
it sleeps. On a quiet machine that saves a wake-up between the short parallel
regions of a step; on a machine where another job takes a core, the spinning
threads burn the time slices the thread they wait for needs, and a decode step
went from 35-48 ms (passive) to 315-650 ms, long enough to look like a hang
(issue 39; measurements and `benchmarks/wait_policy.py` in the perf notes).
"""

from __future__ import annotations

import os
import sys
from collections.abc import MutableMapping

# The environment each policy sets.
POLICIES: dict[str, dict[str, str]] = {
    "libgomp": {},  # libgomp's own default: spin 300,000 rounds, then sleep
    "passive": {"OMP_WAIT_POLICY": "PASSIVE"},  # sleep at once
    "short-spin": {"GOMP_SPINCOUNT": "1000"},  # spin a little (about a microsecond), then sleep
    "active": {"OMP_WAIT_POLICY": "ACTIVE"},  # spin (almost) forever
}
# The policy the entry points apply when neither the user's environment nor a
# flag chose one. short-spin: near libgomp's speed on a quiet machine (B=1 step
# 14.6 vs 12.9 ms; passive 19.9) and near passive's beside a busy core (23.8 vs
# 17.5 ms; libgomp 550); docs/perf-notes.md, "OpenMP's wait policy".
DEFAULT_POLICY = "short-spin"
USER_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def apply_openmp_wait_policy(
    policy: str | None = None, environ: MutableMapping[str, str] | None = None
) -> str:
    """Set the environment for `policy` (None: DEFAULT_POLICY, unless the user's
    environment already sets one of USER_VARIABLES). Returns a line saying what
    applies, for the log."""
    env = os.environ if environ is None else environ
    if policy is not None and policy not in POLICIES:
        raise ValueError(f"--omp-wait-policy must be one of {', '.join(POLICIES)}, got {policy!r}")
    users = {name: env[name] for name in USER_VARIABLES if name in env}
    if policy is None and users:
        chosen = ", ".join(f"{k}={v}" for k, v in users.items())
        return f"OpenMP wait policy: {chosen} (from the environment)"
    name = policy or DEFAULT_POLICY
    for variable in USER_VARIABLES:
        env.pop(variable, None)
    env.update(POLICIES[name])
    late = " (torch was already loaded: no effect in this process)" if "torch" in sys.modules else ""
    settings = ", ".join(f"{k}={v}" for k, v in POLICIES[name].items()) or "libgomp's default"
    return f"OpenMP wait policy: {name} ({settings}){late}"

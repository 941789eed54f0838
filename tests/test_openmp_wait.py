"""The OpenMP wait policy (engine/openmp_wait.py): set by the entry points before
torch loads libgomp, the user's own environment kept unless a flag overrides it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.server_harness import REPO_ROOT
from tokenmill.engine.openmp_wait import DEFAULT_POLICY, POLICIES, apply_openmp_wait_policy


def test_the_default_applies_unless_the_user_chose_and_a_flag_overrides_the_user() -> None:
    env: dict[str, str] = {}
    assert DEFAULT_POLICY in apply_openmp_wait_policy(None, env)
    assert env == POLICIES[DEFAULT_POLICY]

    env = {"GOMP_SPINCOUNT": "5"}
    assert "from the environment" in apply_openmp_wait_policy(None, env)
    assert env == {"GOMP_SPINCOUNT": "5"}

    env = {"OMP_WAIT_POLICY": "ACTIVE", "GOMP_SPINCOUNT": "5"}
    apply_openmp_wait_policy("short-spin", env)
    assert env == {"GOMP_SPINCOUNT": "1000"}
    apply_openmp_wait_policy("libgomp", env)
    assert env == {}

    with pytest.raises(ValueError, match="--omp-wait-policy must be one of"):
        apply_openmp_wait_policy("lazy", {})


@pytest.mark.parametrize("command", ["serve", "generate"])
def test_the_cli_sets_the_policy_before_torch_is_imported(command: str) -> None:
    # The command itself replaced by a probe: what it would find when it starts.
    probe = (
        "import os, sys\n"
        "import tokenmill.cli as cli\n"
        "def probe(args):\n"
        "    print(os.environ.get('OMP_WAIT_POLICY'), os.environ.get('GOMP_SPINCOUNT'),\n"
        "          'torch' in sys.modules)\n"
        "    return 0\n"
        f"cli.cmd_{command} = probe\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    extra = ["hello"] if command == "generate" else []

    def run(*args: str, **more_env: str) -> str:
        result = subprocess.run(
            [sys.executable, "-c", probe, command, *extra, *args], capture_output=True,
            text=True, timeout=120, env={**env, **more_env}, cwd=REPO_ROOT,
        )
        assert result.returncode == 0, result.stderr
        return result.stdout.strip()

    default = POLICIES[DEFAULT_POLICY]
    assert run() == (f"{default.get('OMP_WAIT_POLICY')} {default.get('GOMP_SPINCOUNT')} False")
    assert run("--omp-wait-policy", "passive") == "PASSIVE None False"
    assert run(OMP_WAIT_POLICY="ACTIVE") == "ACTIVE None False"


def test_bench_lora_runs_tokenmill_as_serve_does_and_its_peer_as_the_user_gave_it() -> None:
    probe = (
        "import os, sys\n"
        "import tokenmill.bench.lora as lora\n"
        "import tokenmill.cli as cli\n"
        "def probe(args):\n"
        "    print(os.environ.get('GOMP_SPINCOUNT'), args.peer_environ.get('GOMP_SPINCOUNT'),\n"
        "          'torch' in sys.modules)\n"
        "    return 0\n"
        "lora.main_lora = probe\n"
        "sys.exit(cli.main(sys.argv[1:]))\n"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    env["PYTHONPATH"] = str(REPO_ROOT)
    result = subprocess.run([sys.executable, "-c", probe, "bench", "lora"], capture_output=True,
                            text=True, timeout=120, env=env, cwd=REPO_ROOT)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == f"{POLICIES[DEFAULT_POLICY]['GOMP_SPINCOUNT']} None False"

"""What `paged-cache COMMAND --help` tells a user: every subcommand says what it does, a flag with
fixed choices lists them, a flag for tests is taken but not listed, and the shared-prefill flag
says how long a request may wait."""

from __future__ import annotations

import argparse
import functools

import pytest

from paged_cache.cli.main import build_parser, main
from paged_cache.cli.options import HIDDEN_FIELDS, flag_of
from paged_cache.config import FETCH_POLICIES, SHARED_PREFILL_MAX_WAIT_S
from paged_cache.integrations.shared import prefills

pytestmark = pytest.mark.unit


@functools.cache
def commands() -> dict[str, argparse.ArgumentParser]:
    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def help_of(command: str) -> str:
    return " ".join(commands()[command].format_help().split())   # argparse's wrapping undone


def test_every_subcommand_has_a_description() -> None:
    for name, parser in commands().items():
        assert parser.description and len(parser.description) > 40, name
    assert "least recently used first, the order prune removes them in" in help_of("ls")
    assert "a unique prefix of one" in help_of("show")
    assert "detached trees" in help_of("chains")


def test_fetch_policy_lists_its_choices_and_refuses_others(capsys) -> None:
    assert f"--fetch-policy {{{','.join(FETCH_POLICIES)}}}" in help_of("serve")
    with pytest.raises(SystemExit) as stop:
        main(["config", "--hot-cache-only", "--fetch-policy", "sometimes"])
    assert stop.value.code == 2
    assert "--fetch-policy: invalid choice: 'sometimes'" in capsys.readouterr().err


def test_test_only_flags_are_taken_but_not_listed(capsys) -> None:
    for name in HIDDEN_FIELDS:
        for command in commands():
            assert flag_of(name) not in help_of(command), (command, name)
    # `config` lists the settings a user has, not the test ones, unless one was set
    for argv in (["config", "--hot-cache-only"], ["config", "--hot-cache-only", "--json"]):
        assert main(argv) == 0
        out = capsys.readouterr().out
        assert "block_size" in out and not any(name in out for name in HIDDEN_FIELDS), argv
    assert main(["config", "--hot-cache-only", "--test-ssd-read-bytes-per-s", "1MiB"]) == 0
    out = capsys.readouterr().out
    assert "test_ssd_read_bytes_per_s  1048576  [flag:--test-ssd-read-bytes-per-s]" in out


def test_shared_prefill_help_states_the_longest_wait() -> None:
    assert prefills.MAX_WAIT_SECONDS == SHARED_PREFILL_MAX_WAIT_S
    assert (f"waits for it (until its prefix is stored or its first token is out, at most "
            f"{SHARED_PREFILL_MAX_WAIT_S:g} s)") in help_of("serve")

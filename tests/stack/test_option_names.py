"""The option names are spelled once, in ``tiered_cache.config``: the command line offers exactly them."""

from __future__ import annotations

import argparse

from tiered_cache.config import CODECS, PREFETCH_POLICIES, WRITE_POLICIES


def test_stress_command_choices_are_the_config_names():
    from tiered_cache.engine.stress import add_arguments

    p = argparse.ArgumentParser()
    add_arguments(p)
    choices = {a.dest: tuple(a.choices) for a in p._actions if a.choices is not None}
    assert choices["codec"] == CODECS
    assert choices["write_policy"] == WRITE_POLICIES
    assert choices["prefetch_policy"] == PREFETCH_POLICIES

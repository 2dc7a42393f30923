"""The order `make test` hands files to its workers (tests/conftest.py's LONGEST_FIRST) names files that
exist, and the Makefile keeps xdist from reordering them (a renamed file would silently fall to the
end of the run, where one long file keeps one worker busy alone)."""
from __future__ import annotations

import re

from tests.conftest import LONGEST_FIRST, REPO


def test_longest_first_names_existing_test_files_once():
    missing = [f for f in LONGEST_FIRST if not (REPO / f).is_file()]
    assert not missing, f"tests/conftest.py LONGEST_FIRST names files that do not exist: {missing}"
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)


def test_make_test_keeps_the_order():
    recipe = re.search(r"^test:.*\n\t(.*)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert "--dist loadfile --no-loadscope-reorder" in recipe, recipe

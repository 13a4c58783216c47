"""The examples in orion_par's and the models' docstrings run and give what they show."""

from __future__ import annotations

import doctest
import importlib

import pytest

MODULES = [
    "orion_par", "orion_par.distarray", "orion_par.purity", "orion_par.dependence", "orion_par.scheme",
    "orion_par.partition", "orion_par.relaxed", "orion_par.analyzer", "orion_par.parallel_for", "orion_par.sync",
    "orion_par.checks",
    "models.mf", "models.lda",
]


@pytest.mark.parametrize("name", MODULES)
def test_docstring_examples(name):
    result = doctest.testmod(importlib.import_module(name), optionflags=doctest.ELLIPSIS)
    assert result.failed == 0
    assert result.attempted > 0

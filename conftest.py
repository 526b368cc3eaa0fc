"""Names the docstring examples use (pytest --doctest-modules on src/sparcml)."""

from __future__ import annotations

import pytest
import torch

import sparcml


@pytest.fixture(autouse=True)
def _doctest_names(doctest_namespace: dict) -> None:  # type: ignore[type-arg]
    doctest_namespace.update(torch=torch, sparcml=sparcml, SparseStream=sparcml.SparseStream)

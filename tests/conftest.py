"""Shared fixtures: every test gets its own kernel cache directory, so no test sees another's cache."""

import pytest


@pytest.fixture
def cache_dir(tmp_path, monkeypatch):
    path = tmp_path / "cuep-cache"
    monkeypatch.setenv("CUEP_CACHE_DIR", str(path))
    monkeypatch.delenv("CUEP_JIT_DISABLE_CACHE", raising=False)
    return path

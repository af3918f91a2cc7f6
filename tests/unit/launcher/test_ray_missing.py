"""serve --ray-address without Ray installed: one clear error, before anything starts."""

from __future__ import annotations

import argparse
import sys

import pytest

from services.launcher import serve


def test_a_ray_address_without_ray_installed_asks_for_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "ray", None)  # `import ray` fails as if not installed
    for name in [m for m in sys.modules if m.startswith("services.ray.")]:
        monkeypatch.delitem(sys.modules, name)
    args = argparse.Namespace(
        host="127.0.0.1", api_key=None, allow_unauthenticated=False, ray_address="auto"
    )
    with pytest.raises(ValueError, match=r"pip install 'pagedserve\[ray\]'"):
        serve(args)

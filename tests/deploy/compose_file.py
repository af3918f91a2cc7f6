"""Read docker/compose.yaml as compose would: merge keys, ${VAR:-default} interpolation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import yaml

COMPOSE_FILE = Path(__file__).resolve().parents[2] / "docker" / "compose.yaml"
_VARIABLE = re.compile(r"\$\$|\$\{(\w+)(?:(:?)([-?])([^}]*))?\}|\$(\w+)")


def interpolate(value: Any, env: dict[str, str]) -> Any:
    """Compose's substitution: ${VAR}, ${VAR:-default}, ${VAR-default}, ${VAR:?error},
    ${VAR?error} (a ValueError when VAR is unset, or empty with the colon), $VAR and $$."""
    if isinstance(value, str):

        def substitute(match: re.Match) -> str:
            if match.group(0) == "$$":
                return "$"
            name = match.group(1) or match.group(5)
            colon, operator, argument = match.group(2), match.group(3), match.group(4)
            found = env.get(name)
            missing = found is None or (colon and found == "")
            if operator == "-" and missing:
                return argument
            if operator == "?" and missing:
                raise ValueError(f"{name}: {argument}")
            return found or ""

        return _VARIABLE.sub(substitute, value)
    if isinstance(value, list):
        return [interpolate(v, env) for v in value]
    if isinstance(value, dict):
        return {k: interpolate(v, env) for k, v in value.items()}
    return value


def load_services(env: dict[str, str]) -> dict[str, dict[str, Any]]:
    document = yaml.safe_load(COMPOSE_FILE.read_text())  # SafeLoader resolves `<<` merge keys
    return interpolate(document["services"], env)


def environment_of(service: dict[str, Any]) -> dict[str, str]:
    """A service's `environment:` as a dict (compose accepts a mapping or a KEY=VALUE list)."""
    environment = service.get("environment") or {}
    if isinstance(environment, list):
        environment = dict(item.split("=", 1) for item in environment)
    return {k: "" if v is None else str(v) for k, v in environment.items()}

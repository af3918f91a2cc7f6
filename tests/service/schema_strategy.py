"""Hypothesis strategies for the JSON Schema subset our /openapi.json uses (types, enum, oneOf,
bounds, items, properties, required, additionalProperties)."""

from __future__ import annotations

from typing import Any

from hypothesis import strategies as st

ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=40),
    lambda inner: (
        st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=12), inner, max_size=5)
    ),
    max_leaves=20,
)


def from_schema(schema: dict[str, Any]) -> st.SearchStrategy:
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema or "anyOf" in schema:
        return st.one_of([from_schema(s) for s in schema.get("oneOf", schema.get("anyOf"))])
    kind = schema.get("type")
    if isinstance(kind, list):
        return st.one_of([from_schema({**schema, "type": k}) for k in kind])
    if kind == "object":
        return _object(schema)
    if kind == "array":
        items = from_schema(schema.get("items", {}))
        return st.lists(
            items, min_size=schema.get("minItems", 0), max_size=schema.get("maxItems", 6)
        )
    if kind == "string":
        return st.text(max_size=schema.get("maxLength", 60))
    if kind == "boolean":
        return st.booleans()
    if kind == "integer":
        low, high = schema.get("minimum"), schema.get("maximum")
        if "exclusiveMinimum" in schema:
            low = schema["exclusiveMinimum"] + 1
        return st.integers(min_value=low, max_value=high)
    if kind == "number":
        return st.floats(
            min_value=schema.get("minimum", schema.get("exclusiveMinimum")),
            max_value=schema.get("maximum"),
            exclude_min="exclusiveMinimum" in schema,
            allow_nan=False,
            allow_infinity=False,
        )
    if kind == "null":
        return st.none()
    return ANY_JSON  # no type: anything


def _object(schema: dict[str, Any]) -> st.SearchStrategy:
    properties = schema.get("properties", {})
    required = [k for k in schema.get("required", []) if k in properties]
    optional = [k for k in properties if k not in required]
    extra = schema.get("additionalProperties")
    extra_values = from_schema(extra) if isinstance(extra, dict) else ANY_JSON

    @st.composite
    def build(draw):
        out = {k: draw(from_schema(properties[k])) for k in required}
        for key in draw(st.lists(st.sampled_from(optional), unique=True)) if optional else []:
            out[key] = draw(from_schema(properties[key]))
        if extra is not False and (extra or not properties):
            out |= draw(st.dictionaries(st.text(max_size=8), extra_values, max_size=3))
        return out

    return build()

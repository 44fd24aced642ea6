"""The Prefect UI's run forms: each deployment's parameter schema, titled and described in words.

Prefect builds a deployment's schema from the flow's signature but titles every parameter by its
Python name (``train_data``) and takes descriptions only from a Google-style docstring: a plain
``Annotated[..., Field(title=..., description=...)]`` never reaches the form. A flow parameter
declared with :func:`form_field` carries both in ``json_schema_extra``, which Prefect keeps, so
Prefect's own ``prefect deploy`` gets them too. :func:`form_schema` (what ``imageops serve`` and
``python -m app.deployments`` register) also turns the docstring markup pydantic copies into the
nested models' descriptions (``code``, :func:`name`) into plain text, draws an optional value
as one input that may be left empty or set back to None, and draws the basic fields of a model
with the sections it declares (models.form_sections) after them, each section (and an optional
model saved whole) as one picker of saved settings: Prefect blocks (flows.saved_settings).
"""

from __future__ import annotations

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

from pydantic import Field

from models.form_sections import SCHEMA_KEY, WHOLE_KEY

_ROLE = re.compile(r":[a-z]+:`~?([^`]+)`")  # :func:`tasks.x.y` -> tasks.x.y
_CODE = re.compile(r"`{1,2}([^`]+)`{1,2}")  # ``imageops run`` / `resize_size` -> the words
_PLACEHOLDER = re.compile(r"<([\w .-]+)>")  # timm/<name>: the form's Markdown drops it as a tag


def plain_text(text: str) -> str:
    """``text`` without reStructuredText or Markdown code marks, placeholders in braces."""
    return _PLACEHOLDER.sub(r"{\1}", _CODE.sub(r"\1", _ROLE.sub(r"\1", text)))


# Marks a parameter another flow fills (the tune-trial deployment's study and trial).
_FILLED_BY_A_FLOW = "filled_by_a_flow"


def form_field(
    *, title: str, description: str, filled_by_a_flow: bool = False, **constraints: Any
) -> Any:
    """A flow parameter's ``Field`` whose title and description reach the deployment's form,
    whichever way the deployment is registered (``json_schema_extra`` survives Prefect's own
    schema, which overrides ``title`` with the parameter's name).

    ``filled_by_a_flow``: the form draws it as one JSON input, not a form of its fields (a
    person never fills it; the flow checks it before any step runs)."""
    text = plain_text(description)
    extra = {"title": title, "description": text}
    return Field(
        title=title,
        description=text,
        json_schema_extra={**extra, **({_FILLED_BY_A_FLOW: True} if filled_by_a_flow else {})},
        **constraints,
    )


def form_schema(fn: Callable[..., Any]) -> Any:
    """Prefect's parameter schema of flow function ``fn`` (a ``ParameterSchema``), every
    description, down to the nested models' fields, in plain text, and optional values as one
    input."""
    from prefect.utilities.callables import parameter_schema

    schema = parameter_schema(getattr(fn, "fn", fn))  # a Prefect Flow: its function
    for name, node in schema.properties.items():
        if node.pop(_FILLED_BY_A_FLOW, False):  # one JSON input: no type, no fields
            schema.properties[name] = {k: node[k] for k in ("title", "description", "position")}
    _saved_wholes(schema.properties, schema.definitions)
    _sectioned(schema.properties, schema.definitions)
    for part in (schema.properties, schema.definitions):
        drawn_plainly(part)
    return schema


def drawn_plainly(schema: Any) -> None:
    """Rewrite a JSON schema (or part of one) in place for Prefect's forms: descriptions in plain
    text, an optional value as one input, a list of mixed values as one JSON input. The run
    forms' schemas and the saved settings' block forms (flows.saved_settings) both go through
    it."""
    _plain_descriptions(schema)
    _one_input_for_optional(schema)
    _mixed_lists_as_json(schema)


def every_node(schema: Any) -> Iterator[dict[str, Any]]:
    """Each mapping in a JSON schema (or part of one), parents first: what a caller changes in
    one before asking for the next is walked into."""
    if isinstance(schema, dict):
        yield schema
        for value in list(schema.values()):
            yield from every_node(value)
    elif isinstance(schema, list):
        for item in schema:
            yield from every_node(item)


def _mixed_lists_as_json(schema: Any) -> None:
    """A list whose items may be of several types (a tuning spec's categorical values:
    ``["sgd", "adamw"]``, ``[16, 32]``) as one JSON input, not a switch between types on every
    item; the flow checks each value (tasks.shared.flow_parameters)."""
    for node in every_node(schema):
        items = node.get("items")
        if node.get("type") == "array" and isinstance(items, dict) and "anyOf" in items:
            del node["type"], node["items"]


def _block_definition(slug: str, model: dict[str, Any]) -> dict[str, Any]:
    """The definition a picker of block type ``slug`` points to: the fields of ``model``.

    Keyed by its title, as Prefect's server finds block types. Prefect checks a value against
    ``oneOf`` this and a block reference, and the UI's check drops ``additionalProperties``: a
    reference (``{"$ref": ...}``) would then match both and be refused. The ``$ref`` field, which
    only null matches, keeps the definition from matching one.
    """
    guard = {
        "type": "null",
        "title": "Saved setting",
        "description": "Never filled: a picked setting comes as a block reference.",
    }
    properties = {**model.get("properties", {}), "$ref": guard}
    return {
        **model,
        "title": slug,
        "type": "object",
        "block_type_slug": slug,
        "properties": properties,
        "additionalProperties": False,
    }


def _saved_wholes(properties: dict[str, Any], definitions: dict[str, Any]) -> None:
    """An optional model that is saved whole (models.form_sections.WHOLE_KEY) as a picker.

    Prefect's form cannot leave a model empty: it sends the fields' defaults (the tune form sent
    Init Image Transformation's 224 px for "the data's own transform"). A picker can: empty
    sends nothing (None, the flow's default), a pick sends the saved block's reference. Its
    definition lists the model's fields, so the server checks a value typed in its place.
    """
    for node in [*properties.values(), *(
        p for d in list(definitions.values()) for p in d.get("properties", {}).values()
    )]:  # fmt: skip
        options = node.get("anyOf")
        if not (isinstance(options, list) and len(options) == 2 and {"type": "null"} in options):
            continue
        (ref,) = [o for o in options if o != {"type": "null"}]
        model = definitions.get(ref.get("$ref", "").rsplit("/", 1)[-1], {})
        slug = model.get(WHOLE_KEY)
        if not slug:
            continue
        kept = copy.deepcopy({k: v for k, v in model.items() if k not in (SCHEMA_KEY, WHOLE_KEY)})
        definitions[slug] = _block_definition(slug, kept)
        del node["anyOf"]
        node.pop("default", None)  # None: nothing picked
        node["description"] = f"{node.get('description', '')} Pick a saved one (Add makes one)."
        node["allOf"] = [{"$ref": f"#/definitions/{slug}"}]
    for definition in definitions.values():
        definition.pop(WHOLE_KEY, None)


def _sectioned(properties: dict[str, Any], definitions: dict[str, Any]) -> None:
    """Each model that declares sections: its basic fields, then one picker per section.

    A section becomes a definition of the saved setting's block type (``block_type_slug``, the
    section's fields): the form draws a select of the saved blocks of that type, and the server
    checks a value typed in its place (the API's) against the fields, or takes a block reference
    (Prefect's own rule for block types). Where a default holds values of a section's fields
    (the demo's two processes), they stay in it, flat as the model takes them, and the
    parameter's description names them: left empty, the picker means those.
    """
    sections = {
        name: definition.pop(SCHEMA_KEY)
        for name, definition in definitions.items()
        if SCHEMA_KEY in definition
    }
    if not sections:
        return
    for name, declared in sections.items():
        definition = definitions[name]
        fields = definition["properties"]
        moved = {f for section in declared for f in section["fields"]}
        regrouped = {k: v for k, v in fields.items() if k not in moved}
        for section in declared:
            slug = section["block_type"]
            definitions[slug] = _block_definition(
                slug,
                {"properties": {f: fields[f] for f in section["fields"]}},
            )
            regrouped[section["key"]] = {
                "title": section["title"],
                "description": f"{section['description']} A saved one (Add makes one), or empty: "
                "the defaults.",
                "allOf": [{"$ref": f"#/definitions/{slug}"}],
            }
        definition["properties"] = regrouped
        # The model takes its fields flat too (params.yaml's shape, `prefect deployment run -p
        # 'params={"momentum": 0.8}'`): the server checks them as well, by name. The form draws
        # only ``properties``.
        definition["patternProperties"] = {
            f"^{re.escape(f)}$": copy.deepcopy(fields[f]) for f in sorted(moved)
        }
    for node in [*properties.values(), *(
        p for d in definitions.values() for p in d.get("properties", {}).values()
    )]:  # fmt: skip
        _name_section_defaults(node, definitions, sections)


def _name_section_defaults(
    node: dict[str, Any], definitions: dict[str, Any], sections: dict[str, Any]
) -> None:
    """Append to ``node``'s description the section fields its default sets, by title."""
    refs = [node, *node.get("allOf", []), *node.get("anyOf", [])]
    names = [r["$ref"].rsplit("/", 1)[-1] for r in refs if isinstance(r, dict) and "$ref" in r]
    default = node.get("default")
    if not names or names[0] not in sections or not isinstance(default, dict):
        return
    fields = {
        key[1:-1].replace("\\", ""): field
        for key, field in definitions[names[0]]["patternProperties"].items()
    }
    said = []
    for section in sections[names[0]]:
        own = [  # the values this default sets apart from the block's own defaults
            f"{fields[f].get('title', f)} {_shown(default[f])}"
            for f in section["fields"]
            if default.get(f) is not None and default[f] != fields[f].get("default")
        ]
        if own:
            said.append(f"{section['title']} left empty: {', '.join(own)}, the rest as a new one.")
    if said:
        node["description"] = " ".join([node.get("description", ""), *said])


def _shown(value: Any) -> str:
    if isinstance(value, bool):  # as the form's switches say it
        return "on" if value else "off"
    return str(value)


def _one_input_for_optional(node: Any) -> None:
    """An optional value (``anyOf: [{type: number}, {type: null}]``) as one input, and no
    ``null`` in any default.

    Prefect's form draws ``anyOf`` as a switch between the types, ``null`` reading "Property is
    type None"; a field left empty is what people mean by "the recipe's value". Empty fields are
    left out of what the form sends, and the flow's own defaults fill them with None. So a
    ``null`` may not stay in a default either: the form would send it back and its own check
    (the value's type only, now) refuse it. A choice (an enum, or yes/no) is a select, and a
    select cannot be emptied once set: its options start with None, which the form sends as
    null. An optional nested model is the model: its "none" is a parameter of its own
    (the train deployment's "Train with the data's own transform").
    """
    if isinstance(node, dict):
        options = node.get("anyOf")
        if isinstance(options, list) and len(options) == 2 and {"type": "null"} in options:
            (value,) = [o for o in options if o != {"type": "null"}]
            del node["anyOf"]
            if value.get("type") == "boolean":
                node["enum"] = [None, True, False]
            elif "enum" in value:  # no type: the form's select then offers None (null) too
                node["enum"] = [None, *value["enum"]]
            else:
                node.update(value)
        if "default" in node:
            node["default"] = _without_nulls(node["default"])
            if node["default"] is None:
                del node["default"]
        for value in node.values():
            _one_input_for_optional(value)
    elif isinstance(node, list):
        for item in node:
            _one_input_for_optional(item)


def _without_nulls(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _without_nulls(v) for k, v in value.items() if v is not None}
    if isinstance(value, list):
        return [_without_nulls(v) for v in value]
    return value


def _plain_descriptions(node: Any) -> None:
    if isinstance(node, dict):
        for key, value in node.items():
            if key == "description" and isinstance(value, str):
                node[key] = plain_text(value)
            else:
                _plain_descriptions(value)
    elif isinstance(node, list):
        for item in node:
            _plain_descriptions(item)

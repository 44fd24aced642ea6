"""Sections of a run form: a model's fields grouped as the Prefect UI shows them, and taken back.

Prefect's run form has one way to group fields: a nested object, drawn as a card. A model with
sections shows its basic fields first and the rest in one card per section
(:func:`tasks.shared.forms.form_schema` regroups its schema), and the form sends its values
grouped the same way. The model takes both shapes: grouped from the form, flat as ``params.yaml``,
the CLI and the API write them, so nothing outside the form changes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# Where a model's JSON schema carries its sections for the form (the model's json_schema_extra).
SCHEMA_KEY = "form_sections"


class FormSection(NamedTuple):
    key: str  # the section's key in what the form sends; never one of the model's field names
    title: str
    description: str
    fields: tuple[str, ...]


def schema_extra(sections: tuple[FormSection, ...]) -> dict[str, Any]:
    """The model's ``json_schema_extra``: its sections, for the form to group by."""
    return {SCHEMA_KEY: [section._asdict() for section in sections]}


def flattened(data: Any, sections: tuple[FormSection, ...]) -> Any:
    """``data`` with each section's values lifted to the top: the model's own shape.

    A section's value wins over a flat one of the same field: the form sends a whole parameter,
    and what the run's defaults fill in beside it (flows.config.fills_from) is flat. Anything
    but a mapping under a section's key is left for the model's own check to refuse by name.
    """
    if not isinstance(data, dict) or not any(s.key in data for s in sections):
        return data
    flat = dict(data)
    for section in sections:
        part = flat.get(section.key)
        if isinstance(part, dict):
            del flat[section.key]
            flat.update(part)
    return flat

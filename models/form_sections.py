"""Sections of a run form: the basic fields drawn, each section a saved setting picked by name.

Prefect's run form cannot fold a card, and about 70 fields drawn at once made a form ten screens
tall. A model with sections shows its basic fields; each section is one input that picks a saved
setting (a Prefect block of the section's type, made and edited on the UI's Blocks page, every
field titled and described there) or stays empty: the run's defaults. The form sends a section
as a reference to the block, which Prefect loads before the flow runs. The model takes every
shape: a section as a mapping or a loaded block, or its fields flat as ``params.yaml``, the CLI
and the API write them, so nothing outside the form changes.
"""

from __future__ import annotations

from typing import Any, NamedTuple

from pydantic import BaseModel

# Where a model's JSON schema carries its sections for the form (the model's json_schema_extra).
SCHEMA_KEY = "form_sections"
# Where it names the block type a whole saved one is: an optional parameter of the model (the
# tune flow's transform and study) is then a picker too, empty meaning None.
WHOLE_KEY = "form_block"


class FormSection(NamedTuple):
    key: str  # the section's key in what the form sends; never one of the model's field names
    title: str
    description: str
    fields: tuple[str, ...]

    @property
    def block_type(self) -> str:
        """The slug of the Prefect block type its saved settings are (flows.saved_settings)."""
        return f"imageops-{self.key.replace('_', '-')}"


def schema_extra(
    sections: tuple[FormSection, ...], *, saved_as: str | None = None
) -> dict[str, Any]:
    """The model's ``json_schema_extra``: its sections, for the form to group by, and the block
    type (``saved_as``) a whole one is saved as, where an optional parameter picks it."""
    declared = [{**section._asdict(), "block_type": section.block_type} for section in sections]
    return {SCHEMA_KEY: declared, **({WHOLE_KEY: saved_as} if saved_as else {})}


def fields_of(saved: BaseModel) -> dict[str, Any]:
    """A loaded saved setting (a block) as the mapping of its fields, without what Prefect adds."""
    return {name: getattr(saved, name) for name in type(saved).model_fields}


def flattened(data: Any, sections: tuple[FormSection, ...]) -> Any:
    """``data`` with each section's values lifted to the top: the model's own shape.

    A section's value wins over a flat one of the same field: the form sends a whole parameter,
    and what the run's defaults fill in beside it (flows.config.fills_from) is flat. A saved
    setting the form picked arrives as the block Prefect loaded: all its fields, as saved.
    Anything else under a section's key is left for the model's own check to refuse by name.
    """
    if isinstance(data, BaseModel):  # a whole saved one the form picked
        data = fields_of(data)
    if not isinstance(data, dict) or not any(s.key in data for s in sections):
        return data
    flat = dict(data)
    for section in sections:
        part = flat.get(section.key)
        if isinstance(part, BaseModel):
            part = fields_of(part)
        if isinstance(part, dict):
            del flat[section.key]
            flat.update(part)
    return flat

"""``--help`` laid out for the terminal's width: option names whole, descriptions wide enough to
read, paragraphs wrapped by the renderer.

Typer's own rich layout sizes every column of its options table alike, so on an 80-column
terminal long option names are cut (``--accumulation-s…``) and descriptions wrap a word a line;
and it keeps the single line breaks of docstrings, which are wrapped at the source's width.
Here an options panel is a table while its descriptions get at least
:data:`MIN_DESCRIPTION_WIDTH` columns, else each option takes two lines: its names and type,
then its description, indented, across the panel. Paragraphs are joined before rich wraps them.
The cells are typer's own (names, types, help with its default), so a wide terminal shows what
typer shows. They come from helpers of ``typer.rich_utils`` that typer does not publish
(requirements.lock pins typer): a typer that renames them fails
``tests/test_cli.py::test_every_help_reads_well_at_80_columns``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Sequence
from typing import Any

import typer
from rich.console import Console, Group, RenderableType
from rich.padding import Padding
from rich.panel import Panel
from rich.table import Table
from rich.text import Text
from typer import rich_utils
from typer.core import TyperArgument, TyperCommand, TyperGroup

MIN_DESCRIPTION_WIDTH = 40
# A panel's border and padding on each side; a table's space between two columns.
PANEL_EDGES = 4
COLUMN_GAP = 2
TWO_LINE_INDENT = 4


class HelpCommand(TyperCommand):
    """A command whose ``--help`` is laid out for the terminal's width."""

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        print_help(self, ctx)


class HelpGroup(TyperGroup):
    """A group of commands whose ``--help`` is laid out for the terminal's width."""

    def format_help(self, ctx: typer.Context, formatter: Any) -> None:
        print_help(self, ctx)


class HelpTyper(typer.Typer):
    """A Typer app whose group and commands print their ``--help`` with this module's layout."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(cls=HelpGroup, **kwargs)

    def command(
        self, name: str | None = None, *, cls: type[TyperCommand] = HelpCommand, **kwargs: Any
    ) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
        return super().command(name, cls=cls, **kwargs)


def paragraphs(help_text: str, first_style: str = "", rest_style: str = "dim") -> Text:
    """``help_text`` (a docstring: paragraphs split by blank lines, each wrapped at the source's
    width) as rich text whose paragraphs are one line each, for the renderer to wrap."""
    text = inspect.cleandoc(help_text).partition("\f")[0]
    joined = [" ".join(p.split()) for p in text.split("\n\n") if p.strip()]
    parts = [
        Text.from_markup(p, style=first_style if i == 0 else rest_style)
        for i, p in enumerate(joined)
    ]
    return rich_utils.highlighter(Text("\n\n").join(parts))


def print_help(command: HelpCommand | HelpGroup, ctx: typer.Context) -> None:
    """Print ``command``'s help: usage, its paragraphs, its parameters' panels, its commands."""
    console = rich_utils._get_rich_console()
    usage = rich_utils.highlighter(command.get_usage(ctx))
    console.print(Padding(usage, 1), style=rich_utils.STYLE_USAGE_COMMAND)
    if command.help:
        console.print(Padding(paragraphs(command.help), (0, 1, 1, 1)))
    panels: dict[str, list[Any]] = {
        rich_utils.ARGUMENTS_PANEL_TITLE: [],
        rich_utils.OPTIONS_PANEL_TITLE: [],
    }
    for param in sorted(command.get_params(ctx), key=lambda p: not isinstance(p, TyperArgument)):
        if getattr(param, "hidden", False):
            continue
        default = (
            rich_utils.ARGUMENTS_PANEL_TITLE
            if isinstance(param, TyperArgument)
            else rich_utils.OPTIONS_PANEL_TITLE
        )
        panels.setdefault(getattr(param, "rich_help_panel", None) or default, []).append(param)
    for title, params in panels.items():
        if params:
            console.print(_panel(title, _params_layout(params, ctx, console)))
    if isinstance(command, TyperGroup):
        commands = [command.get_command(ctx, name) for name in command.list_commands(ctx)]
        shown = [c for c in commands if c is not None and not c.hidden]
        if shown:
            console.print(_panel(rich_utils.COMMANDS_PANEL_TITLE, _commands_table(shown)))
    if command.epilog:
        console.print(Padding(paragraphs(command.epilog, rest_style=""), 1))


def _panel(title: str, body: RenderableType) -> Panel:
    return Panel(
        body,
        border_style=rich_utils.STYLE_OPTIONS_PANEL_BORDER,
        title=title,
        title_align=rich_utils.ALIGN_OPTIONS_PANEL,
    )


def _params_layout(params: Sequence[Any], ctx: typer.Context, console: Console) -> RenderableType:
    """A table of the parameters when their descriptions get :data:`MIN_DESCRIPTION_WIDTH`
    columns beside the names, else two lines a parameter."""
    rows = [_param_cells(param, ctx) for param in params]
    # the columns before the description (required mark, names, negative names, type): those
    # some parameter fills, each as wide as its widest cell
    widths = {i: max(row[i].cell_len for row in rows) for i in range(len(rows[0]) - 1)}
    widths = {i: width for i, width in widths.items() if width}
    beside = console.width - PANEL_EDGES - sum(w + COLUMN_GAP for w in widths.values())
    if beside >= MIN_DESCRIPTION_WIDTH:
        table = Table(show_header=False, box=None, expand=True, padding=(0, 1), pad_edge=False)
        for width in widths.values():
            table.add_column(no_wrap=True, width=width)
        table.add_column(ratio=1)
        for row in rows:
            table.add_row(*(row[i] for i in widths), row[-1])
        return table
    entries: list[RenderableType] = []
    for required, names, negative, kind, description in rows:
        head = Text(" ").join(cell for cell in (required, names, negative, kind) if cell)
        entries.extend([head, Padding(description, (0, 0, 0, TWO_LINE_INDENT))])
    return Group(*entries)


def _param_cells(param: Any, ctx: typer.Context) -> tuple[Text, Text, Text, Text, Text]:
    """Typer's cells for ``param``: required mark, names, negative names (``--no-x``), type, and
    the help with its default, as one paragraph."""
    if isinstance(param, TyperArgument):
        many = param.metavar is None and param.nargs != 1
        names = param.display_name_raw + ("..." if many else "")
    else:
        names = ", ".join(param.opts)
    kind = Text(param.display_type_rich(ctx=ctx) or "", style=rich_utils.STYLE_TYPES)
    if value_range := param._get_number_range_help_str():
        kind.append(rich_utils.RANGE_STRING.format(value_range))
    help_parts = rich_utils._get_parameter_help(
        param=param, ctx=ctx, markup_mode=rich_utils.MARKUP_MODE_RICH
    ).renderables
    required = rich_utils.REQUIRED_SHORT_STRING if param.required else ""
    return (
        Text(required, style=rich_utils.STYLE_REQUIRED_SHORT),
        rich_utils.highlighter(Text(names)),
        rich_utils.negative_highlighter(Text(", ".join(param.secondary_opts))),
        rich_utils.types_highlighter(kind),
        Text(" ").join(help_parts),
    )


def _commands_table(commands: Sequence[Any]) -> Table:
    """The sub-commands, each with the first paragraph of its help."""
    table = Table(show_header=False, box=None, expand=True, padding=(0, 1), pad_edge=False)
    table.add_column(
        style=rich_utils.STYLE_COMMANDS_TABLE_FIRST_COLUMN,
        no_wrap=True,
        width=max(len(c.name or "") for c in commands),
    )
    table.add_column(ratio=1)
    for command in commands:
        summary = inspect.cleandoc(command.short_help or command.help or "").split("\n\n")[0]
        table.add_row(command.name or "", paragraphs(summary, rest_style=""))
    return table

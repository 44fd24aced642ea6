"""``imageops team server`` and ``imageops team join``: a team on several machines, with logins."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape

from app.cli.help_layout import HelpTyper
from app.cli.root import app, err, out
from tasks.shared.settings import get_settings

team_app = HelpTyper(
    help="A team on several machines: `server` runs the shared services (PostgreSQL, S3, MLflow, "
    "Prefect, Ray head; each with a login) on one machine, `join` adds a GPU machine (Ray node "
    "and Prefect worker). See docs/team.md, 'A team on several machines'.",
    no_args_is_help=True,
)
app.add_typer(team_app, name="team")
JOIN_PLACE = "~/.config/imageops"  # where the join file goes on a GPU machine (default_join_file)


@team_app.command("server")
def team_server(
    host: Annotated[
        str,
        typer.Option(
            help="The server machine's address that the GPU machines reach; every server "
            "listens on it and the join file gives it out. 127.0.0.1: this machine only."
        ),
    ] = "127.0.0.1",
    prefect_port: Annotated[int, typer.Option(help="Prefect server, API and UI port.")] = 4200,
    mlflow_port: Annotated[int, typer.Option(help="MLflow server and UI port.")] = 5000,
    s3_port: Annotated[int, typer.Option(help="S3 (SeaweedFS) port.")] = 8333,
    postgres_port: Annotated[int, typer.Option(help="PostgreSQL port.")] = 5432,
    ray_port: Annotated[int, typer.Option(help="Ray head (GCS) port.")] = 6379,
    ui: Annotated[bool, typer.Option(help="Serve the Prefect UI.")] = True,
) -> None:
    """Run the team's shared services on this machine until Ctrl-C; write the join file."""
    from app.team import TeamPorts, TeamServer
    from tasks.shared.servers import stop_signals

    ports = TeamPorts(
        prefect=prefect_port, mlflow=mlflow_port, s3=s3_port, postgres=postgres_port, ray=ray_port
    )
    stack = TeamServer(
        get_settings(), host=host, ports=ports, ui=ui,
        say=lambda message: err.print(f"[dim]{escape(message)}[/]"),
    )  # fmt: skip
    err.print("starting PostgreSQL, S3, MLflow, Prefect and the Ray head ...")
    with stop_signals():
        try:
            stack.start()
            out.print(f"[bold]Prefect UI[/]  {stack.prefect_url}  (login: the auth string)")
            out.print(f"[bold]MLflow UI[/]   {stack.mlflow_url}  (user admin)")
            out.print(f"[bold]S3[/]          {stack.s3_url}")
            out.print(f"[bold]Ray head[/]    {stack.ray_address}")
            out.print(f"[bold]Logs[/]        {stack.dir / 'logs'}")
            out.print(f"[bold]Secrets[/]     {stack.secrets_dir} (mode 0600)")
            out.print(f"[bold]Join file[/]   {stack.join_file} (mode 0600)")
            joined = f"{JOIN_PLACE}/team.env"  # outside the checkout: git never sees it
            out.print("On each GPU machine, from its project checkout:")
            out.print(escape(f"  mkdir -p {JOIN_PLACE} && scp {host}:{stack.join_file} {joined}"))
            out.print(escape(f"  chmod 600 {joined}"))
            out.print("  . .venv/bin/activate && imageops team join")
            out.print("[bold]ready[/]; Ctrl-C stops everything")
            stack.serve_forever()
        except KeyboardInterrupt:
            err.print("stopping ...")
        finally:
            said = stack.stop()
    err.print(said)


@team_app.command("join")
def team_join(
    env: Annotated[
        Path | None,
        typer.Option(
            "--env",
            help="The join file copied from the server machine (<home>/team/team.env), mode "
            f"0600; default: {JOIN_PLACE}/team.env ($XDG_CONFIG_HOME/imageops when set), "
            "outside the checkout, where git does not look.",
            show_default=False,
        ),
    ] = None,
    node_ip: Annotated[
        str | None,
        typer.Option(
            help="This machine's address that the other machines reach (Ray connects both "
            "ways); default: the one on the route to the server."
        ),
    ] = None,
    pool: Annotated[
        str, typer.Option(help="Work pool of this machine's Prefect worker.")
    ] = "local",
    num_cpus: Annotated[
        int | None, typer.Option(help="CPUs this machine gives Ray; default: all.")
    ] = None,
    num_gpus: Annotated[
        int | None, typer.Option(help="GPUs this machine gives Ray; default: all.")
    ] = None,
) -> None:
    """Join this GPU machine to the team: a Ray node and a Prefect worker, until Ctrl-C."""
    from app.team_join import TeamMember
    from tasks.shared.servers import stop_signals

    member = TeamMember(
        get_settings(), env, node_ip=node_ip, pool=pool, num_cpus=num_cpus, num_gpus=num_gpus,
        say=lambda message: err.print(f"[dim]{escape(message)}[/]"),
    )  # fmt: skip
    err.print(f"checking the servers of {member.join_file} ...")
    with stop_signals():
        try:
            member.start()
            out.print(f"[bold]Ray node[/]        {member.node_ip} in {member.ray_address}")
            out.print(f"[bold]Prefect worker[/]  {member.worker_name} on pool `{pool}`")
            out.print(f"[bold]Logs[/]            {member.dir / 'logs'}")
            out.print("[bold]joined[/]; Ctrl-C leaves the team")
            member.serve_forever()
        except KeyboardInterrupt:
            err.print("leaving ...")
        finally:
            said = member.stop()
    err.print(said)

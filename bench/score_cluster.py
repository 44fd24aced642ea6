"""Scoring on the Ray cluster: two hosts of one core each against one host with two cores.

Usage: ``python -m bench.score_cluster [--full] [--json PATH]``

Hosts (as root): three network namespaces on a bridge (the test suite's hosts, tests/hosts.py),
each with its own code, home and Ray node, sharing nothing but the network and the disk the
images are on. Two clusters are up for the whole run, so every round finds both warm:

- **two hosts**: a head on host A pinned to one core (``taskset``, ``--num-cpus 1``) and a node
  on host B pinned to the other, joined to it;
- **one host**: a head on host C with both cores (``--num-cpus 2``).

Each case scores the same folder of digit images at 32 px (the 1,797 scans linked again and again,
as ``bench.score_speed`` builds its scaling folders) with an untrained resnet18 at 32 px, batch 64,
through :func:`tasks.inference.score.on_cluster.score_on_cluster` as ``imageops score --cluster``
runs it: a driver process on the case's first host, pinned to that host's cores, times the call
(connecting, listing, the job, the whole CSV written), without the Python imports. The two cases
alternate which goes first; the efficiency is each round's two hosts' images/s over one host's.
While a case runs, every process of each of its hosts is sampled (PSS from ``smaps_rollup``, so
shared pages count once) for the node's peak memory.

``--full``: 3 rounds instead of 2, then a million images on the two hosts: time, images/s, peak
memory per node and the driver's own peak RSS (``VmHWM``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if __package__ in (None, ""):  # `python bench/score_cluster.py`
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.report import ROOT, Section, Stat, Table, peak_rss_mb, run_main

if TYPE_CHECKING:
    from hosts import Host, Hosts

sys.path.insert(0, str(ROOT / "tests"))  # the namespace hosts of the test suite

GOAL = 0.9  # two 1-core hosts' images/s over one 2-core host's: the issue's goal
SIZE = 32  # px: the smallest input resnet18 takes
BATCH = 64  # score's default
PY = sys.executable
RAY = str(Path(PY).with_name("ray"))
DRIVER = "--driver"  # argv[1] of the driver process: MODEL IMAGES DEST CLUSTER
SAMPLE_EVERY_S = 1.0  # the node memory sampler's pace


@dataclass(frozen=True)
class Plan:
    """Sizes and repeats of one run (quick or ``--full``)."""

    images: int  # per case and round: enough for a job to run well past its start-up
    rounds: int
    million: int = 0  # images of the one big run on the two hosts; 0: none


QUICK = Plan(images=10_000, rounds=2)
FULL = Plan(images=20_000, rounds=3, million=1_000_000)
ONE_BATCH = BATCH  # images of the job that times a job's start-up (and warms each cluster)


@dataclass
class Case:
    """One cluster: its hosts (the first runs the head and the driver) and their cores; the
    figures of its jobs, a round each."""

    label: str
    hosts: list[Host]
    cores: list[str]  # per host, as taskset takes them ("0", "0,1")
    address: str = ""
    startups: list[dict[str, float]] = field(default_factory=list)  # one-batch jobs
    results: list[dict[str, float]] = field(default_factory=list)  # plan.images jobs

    @property
    def driver(self) -> Host:
        return self.hosts[0]


def driver(model: str, images: str, dest: str, cluster: str) -> int:
    """In the driver process: time one scoring on the cluster; print JSON with its figures."""
    from tasks.inference.score.on_cluster import ClusterScoring, score_on_cluster

    start = time.perf_counter()
    score_on_cluster(ClusterScoring(model=Path(model), images=Path(images), dest=Path(dest),
                                    cluster=cluster, batch_size=BATCH))  # fmt: skip
    seconds = time.perf_counter() - start
    with open(dest, "rb") as table:  # every image one row, below the header
        rows = sum(chunk.count(b"\n") for chunk in iter(lambda: table.read(1 << 20), b"")) - 1
    print(json.dumps({"seconds": seconds, "rows": rows, "peak_mb": peak_rss_mb()}))
    return 0


class NodeMemory:
    """The peak, over a run, of each host's memory: PSS summed over all of its processes."""

    def __init__(self, hosts: list[Host]) -> None:
        self.hosts, self.peak_mb = hosts, [0.0] * len(hosts)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True, name="node-memory")

    def __enter__(self) -> NodeMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(SAMPLE_EVERY_S):
            for i, host in enumerate(self.hosts):
                total = sum(_pss_mb(pid) for pid in host.pids())
                self.peak_mb[i] = max(self.peak_mb[i], total)


def _pss_mb(pid: int) -> float:
    with contextlib.suppress(OSError, ValueError):  # ended meanwhile
        for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
            if line.startswith("Pss:"):
                return int(line.split()[1]) / 1024  # kB
    return 0.0


def start_cluster(hosts: Hosts, case: Case, ray_tmp: list[Path]) -> None:
    """A head on the case's first host and a node on each other one, pinned to their cores."""
    from server_processes import RAY_NODE

    head = case.driver
    case.address = f"{head.address}:6379"
    for host, cores in zip(case.hosts, case.cores, strict=True):
        ray_tmp.append(Path(tempfile.mkdtemp(prefix="ray", dir="/tmp")))
        command = ["taskset", "-c", cores, RAY, "start", "--block",
                   "--num-cpus", str(len(cores.split(","))), "--disable-usage-stats",
                   "--temp-dir", str(ray_tmp[-1]), "--node-ip-address", host.address]  # fmt: skip
        if host is head:
            command += ["--head", "--port", "6379", "--include-dashboard=false"]
        else:
            command += ["--address", case.address]
        hosts.start(host, "ray", command, **RAY_NODE)


def score_once(case: Case, model: Path, images: Path, count: int, work: Path) -> dict[str, float]:
    """One scoring of ``images`` on the case's cluster, driven from its first host: figures."""
    host = case.driver
    dest = work / f"{host.name}-table.csv"
    command = ["taskset", "-c", case.cores[0], PY, "-m", "bench.score_cluster", DRIVER,
               str(model), str(images), str(dest), case.address]  # fmt: skip
    # The host's own copy of the code first; bench/ (not part of a host's code) from here.
    with NodeMemory(case.hosts) as memory:
        done = host.run(command, 4 * 3600, PYTHONPATH=f"{host.project}:{ROOT}")
    dest.unlink(missing_ok=True)
    if done.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed on {host.name}:\n{done.stderr[-4000:]}")
    figures = json.loads(done.stdout.strip().splitlines()[-1])
    if figures["rows"] != count:
        raise RuntimeError(f"{case.label}: {figures['rows']} rows for {count} images")
    return figures | {f"node_mb_{i}": mb for i, mb in enumerate(memory.peak_mb)}


def prepare(work: Path, counts: list[int]) -> tuple[Path, dict[int, Path]]:
    """The model (exported) and a folder of digit images for each of ``counts``."""
    from bench.score_speed import untrained_model, write_many
    from tasks.data.sample import write_digits
    from tasks.inference.export import export_onnx

    model = untrained_model(work / "model", SIZE)
    export_onnx(model, sample=None)
    scans = sorted(write_digits(work / "scans", size=SIZE).rglob("*.png"))
    folders = {}
    for count in sorted(set(counts)):
        began = time.perf_counter()
        folders[count] = write_many(work / f"images-{count}", scans, count)
        print(f"{count:,} images linked ({time.perf_counter() - began:.0f} s)", flush=True)
    return model, folders


def run(full: bool, work: Path) -> Section:
    from hosts import can_make_hosts

    plan = FULL if full else QUICK
    cores = sorted(os.sched_getaffinity(0))
    why_not = can_make_hosts() or (
        f"needs 2 cores, this process may use {len(cores)}" if len(cores) < 2 else None
    )
    section = Section(
        key="score_cluster",
        title="Scoring on the cluster: two 1-core hosts against one 2-core host",
        command=f"python -m bench.score_cluster{' --full' if full else ''}",
    )
    if why_not is not None:
        section.text = [f"Not measured ({why_not})."]
        return section
    return measure(plan, work, [str(c) for c in cores[:2]], section)


def measure(plan: Plan, work: Path, cores: list[str], section: Section) -> Section:
    """Both clusters up, the rounds, then (``plan.million``) the big run: ``section`` filled."""
    from hosts import Hosts

    from bench.scale_out import wait_for_nodes

    model, folders = prepare(work, [ONE_BATCH, plan.images] + [plan.million] * bool(plan.million))
    ray_tmp: list[Path] = []
    hosts = Hosts(work / "hosts", count=3)
    with hosts:
        a, b, c = hosts.hosts
        two = Case("two hosts, 1 core each (A: head and driver, B: node)", [a, b], cores)
        one = Case("one host, 2 cores (C: head and driver)", [c], [",".join(cores)])
        try:
            for case in (two, one):
                start_cluster(hosts, case, ray_tmp)
            for case in (two, one):
                wait_for_nodes(hosts, case.driver, len(case.hosts))
                score_once(case, model, folders[ONE_BATCH], ONE_BATCH, work)  # untimed: warm
            for round_ in range(plan.rounds):
                for case in (two, one) if round_ % 2 == 0 else (one, two):
                    startup = score_once(case, model, folders[ONE_BATCH], ONE_BATCH, work)
                    case.startups.append(startup)
                    job = score_once(case, model, folders[plan.images], plan.images, work)
                    case.results.append(job)
                    print(
                        f"round {round_ + 1}: {case.label}: {ONE_BATCH} images in "
                        f"{startup['seconds']:.1f} s, {plan.images:,} in {job['seconds']:.1f} s, "
                        f"load average {os.getloadavg()[0]:.1f}",
                        flush=True,
                    )
            million = (
                score_once(two, model, folders[plan.million], plan.million, work)
                if plan.million
                else None
            )
        finally:
            for folder in ray_tmp:
                shutil.rmtree(folder, ignore_errors=True)
    return filled(section, plan, two, one, million)


def filled(
    section: Section, plan: Plan, two: Case, one: Case, million: dict[str, float] | None
) -> Section:
    """The section's text and tables from the cases' figures."""
    from bench.score_speed import plural

    n = plan.images

    def rates(case: Case) -> list[float]:
        return [n / r["seconds"] for r in case.results]

    def past_startup(case: Case) -> list[float]:
        """images/s once a job runs: the big job's images less one batch over the time it took
        more than the one-batch job of the same round."""
        return [
            (n - ONE_BATCH) / max(r["seconds"] - s["seconds"], 1e-3)
            for r, s in zip(case.results, case.startups, strict=True)
        ]

    def memory(case: Case, results: list[dict[str, float]]) -> str:
        return ", ".join(
            f"{host.name[-1].upper()} {Stat([r[f'node_mb_{i}'] for r in results], 'MB').format()}"
            for i, host in enumerate(case.hosts)
        )

    def ratio(of: Callable[[Case], list[float]]) -> Stat:
        return Stat([t / o for t, o in zip(of(two), of(one), strict=True)], "x")

    efficiency, steady = ratio(rates), ratio(past_startup)
    section.tables.append(
        Table(
            [
                "case",
                f"a {ONE_BATCH}-image job",
                f"{n:,} images",
                "past start-up",
                "peak memory per host (PSS)",
            ],
            [
                [
                    case.label,
                    Stat([s["seconds"] for s in case.startups], "s"),
                    Stat(rates(case), "images/s"),
                    Stat(past_startup(case), "images/s"),
                    memory(case, case.results),
                ]
                for case in (one, two)
            ]
            + [["two hosts / one host (per round)", "", efficiency, steady, ""]],
            title=f"Scoring at {SIZE} px, {plural(plan.rounds, 'round')}",
        )
    )
    met = "met" if efficiency.median >= GOAL else "NOT MET"
    section.text = [
        f"An untrained resnet18 at {SIZE} px exported to ONNX, batch {BATCH}, the 1,797 digit "
        f"scans at {SIZE} px linked into folders of {ONE_BATCH} and {n:,} images. "
        "`score_on_cluster` (what `imageops score --cluster` calls) is timed in a driver process "
        "on each case's first host, pinned to that host's cores: connecting, listing, the job "
        "and the whole CSV, not the Python imports. Three network-namespace hosts; both clusters "
        f"stay up for the whole run, each warmed by one untimed {ONE_BATCH}-image job. Each round "
        f"runs, per case, a {ONE_BATCH}-image job (the start-up: connecting, planning, the "
        f"actors' start) and then the {n:,}-image job; which case goes first alternates. Past "
        f"start-up: ({n:,} - {ONE_BATCH}) images over the difference of the two jobs' times, "
        "what a much longer job (a million images) would approach. Both cases run on the same "
        "two cores: the efficiency is what crossing hosts (veth, Ray's object transfers between "
        "nodes, two nodes' own processes) costs. Memory: the peak of the PSS summed over all of "
        "a host's processes (its Ray node, its workers, and on the first host the driver), "
        f"sampled every {SAMPLE_EVERY_S:g} s.",
        f"**Goal: two 1-core hosts at least {GOAL}x one 2-core host's images/s: {met}** "
        f"({efficiency.format()} end to end over {n:,} images; past start-up {steady.format()}).",
    ]
    if million is None:
        section.text.append("A million images on the two hosts: with `--full`.")
        return section
    seconds = million["seconds"]
    section.tables.append(
        Table(
            ["images", "time", "images/s", "peak memory per host (PSS)", "driver's peak RSS"],
            [
                [
                    plan.million,
                    f"{seconds / 60:.1f} min",
                    f"{plan.million / seconds:,.0f} images/s",
                    memory(two, [million]),
                    f"{million['peak_mb']:,.0f} MB",
                ]
            ],
            title=f"{plan.million:,} images at {SIZE} px on the two hosts (1 core each), one run",
        )
    )
    return section


if __name__ == "__main__":
    if sys.argv[1:2] == [DRIVER]:
        sys.exit(driver(*sys.argv[2:]))
    sys.exit(run_main(run, __doc__.split("\n\n")[0]))

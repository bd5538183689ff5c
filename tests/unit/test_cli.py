"""The CLIs as a new user meets them: help that shows, flags that say their defaults, and
usage errors that name the flag and the allowed range before anything runs."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest

from kvlink.bench.runner import progress_label
from kvlink.cli import bench as cli_bench
from kvlink.cli import demo as cli_demo
from kvlink.cli import testbed as cli_testbed


def _run(module: str, argv: tuple[str, ...], timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True,
                          timeout=timeout, check=False)  # fmt: skip


def cli(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`kvlink ARGV...` in a subprocess."""
    return _run("kvlink.cli.main", argv, timeout)


def bench(*argv: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    """`kvlink-bench ARGV...` in a subprocess."""
    return _run("kvlink.cli.bench", argv, timeout)


@pytest.mark.parametrize(
    "argv,usage",
    [
        (["testbed", "--help"], "usage: kvlink testbed [-h]"),
        (["testbed", "up", "--help"], "usage: kvlink testbed up [-h]"),
        (["testbed", "set", "--help"], "usage: kvlink testbed set [-h]"),
        (["bench", "--help"], "usage: kvlink bench [-h]"),
        (["bench", "loopback", "--help"], "usage: kvlink bench loopback [-h]"),
        (["bench", "demo", "--help"], "usage: kvlink bench demo [-h]"),
    ],
)
def test_a_commands_help_is_its_own(argv, usage):
    out = cli(*argv)
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith(usage), out.stdout[:200]
    assert "operational commands" not in out.stdout  # not kvlink's top-level help


def test_top_level_help_lists_the_commands():
    out = cli("--help")
    assert out.returncode == 0
    assert "testbed" in out.stdout and "bench" in out.stdout


def _parsers() -> list[tuple[str, argparse.ArgumentParser]]:
    """Every parser of kvlink-bench and kvlink testbed, subcommands included."""
    out = []
    for name, top in (("kvlink-bench", cli_bench.build_parser()),
                      ("kvlink testbed", cli_testbed._parser())):  # fmt: skip
        out.append((name, top))
        for action in top._actions:
            if isinstance(action, argparse._SubParsersAction):
                for sub, p in action.choices.items():
                    if sub != "demo":  # its own parser, below
                        out.append((f"{name} {sub}", p))
    out.append(("kvlink-bench demo", cli_demo.build_parser()))
    return out


@pytest.mark.parametrize("name,parser", _parsers(), ids=[n for n, _ in _parsers()])
def test_every_flag_has_help_and_shows_its_default(name, parser):
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        flag = "/".join(action.option_strings) or action.dest
        assert action.help, f"{name} {flag}: no help text"
        takes_value = action.option_strings and action.nargs != 0
        if takes_value and not action.required and action.default is not argparse.SUPPRESS:
            assert "default" in action.help, f"{name} {flag}: help does not show the default"


@pytest.mark.parametrize("command", ["loopback", "testbed", "run", "demo"])
def test_throughput_is_said_to_be_gb_per_second(command):
    out = bench(command, "--help")
    assert out.returncode == 0
    assert "GB/s" in out.stdout
    assert "1e9 bytes" in " ".join(out.stdout.split())


def test_help_shows_the_quick_defaults():
    out = cli("bench", "loopback", "--help")
    text = " ".join(out.stdout.split())
    assert "(default: 4; with --quick: 2)" in text
    assert "(default: 1GiB; with --quick: 16MiB)" in text


@pytest.mark.parametrize(
    "argv,message",
    [
        (["loopback", "--paths", "0"], "argument --paths: 0 is out of range: must be from 1 to 64"),
        (["loopback", "--paths", "100"], "argument --paths: 100 is out of range"),
        (["loopback", "--quick", "--paths", "0"], "argument --paths: 0 is out of range"),
        (["loopback", "--size", "0"], "argument --size: '0': a size must be at least 1 byte"),
        (["loopback", "--size", "64MiB,0"], "a size must be at least 1 byte"),
        (["loopback", "--size", "lots"], "argument --size: not a size: 'lots'"),
        (["loopback", "--chunk", "0"], "argument --chunk: '0': a size must be at least 1 byte"),
        (["loopback", "--iters", "0"], "argument --iters: 0 is out of range: must be at least 1"),
        (["loopback", "--warmup", "-1"], "argument --warmup: -1 is out of range"),
        (["loopback", "--concurrency", "0"], "argument --concurrency: 0 is out of range"),
        (["serve", "--size", "0"], "argument --size: '0': a size must be at least 1 byte"),
        (["testbed", "--links", "0"], "argument --links: 0 is out of range"),
        (["testbed", "--subnet-base", "600"], "argument --subnet-base: 600 is out of range"),
        (["demo", "--paths", "0"], "argument --paths: 0 is out of range: must be from 1 to 64"),
        (["demo", "--timeout", "0"], "argument --timeout: 0: must be more than 0 seconds"),
    ],
)
def test_out_of_range_values_are_refused_up_front(argv, message):
    out = bench(*argv)
    assert out.returncode == 2, out.stdout + out.stderr
    assert message in out.stderr
    assert "Traceback" not in out.stderr


def test_plot_without_matplotlib_is_refused_before_the_run():
    code = (
        "import sys; sys.modules['matplotlib'] = None\n"  # as if it were not installed
        "from kvlink.cli.bench import main\n"
        "sys.exit(main(['loopback', '--quick', '--plot', 'out.png']))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=30, check=False)  # fmt: skip
    assert out.returncode == 2
    assert "pip install kvlink[plot]" in out.stderr
    assert out.stdout == ""  # nothing ran


def test_run_against_nothing_says_which_address_and_what_to_do():
    out = bench("run", "--connect", "127.0.0.1:1", "--quick")
    assert out.returncode == 1
    assert "cannot reach kvlink-bench serve at 127.0.0.1:1" in out.stderr
    assert "start `kvlink-bench serve`" in out.stderr
    assert "Traceback" not in out.stderr


def test_run_with_a_malformed_address_is_named():
    out = bench("run", "--connect", "nohostport", "--quick")
    assert out.returncode == 1
    assert "--connect: expected HOST:PORT, got 'nohostport'" in out.stderr


def test_quick_changes_only_the_flags_not_given():
    args = cli_bench.build_parser().parse_args(
        ["loopback", "--quick", "--paths", "3", "--size", "32MiB", "--iters", "1"]
    )
    cli_bench.resolve(args)
    assert (args.paths, args.size, args.iters) == (3, [32 << 20], 1)
    assert (args.chunk, args.warmup) == ([0], 1)  # from --quick
    args = cli_bench.build_parser().parse_args(["loopback"])
    cli_bench.resolve(args)
    assert (args.paths, args.size, args.iters) == (4, [1 << 30], 5)


@pytest.mark.parametrize(
    "op,size,chunk,label",
    [
        ("push", 64 << 20, 0, "push 64MiB, chunk auto"),
        ("pull", 1 << 30, 4 << 20, "pull 1GiB, chunk 4MiB"),
        ("push", 20_000_000, 0, "push 20MB, chunk auto"),
    ],
)
def test_progress_labels_are_human(op, size, chunk, label):
    assert progress_label(op, size, chunk) == label

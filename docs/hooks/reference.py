"""MkDocs hook: the reference pages that cannot drift, written at every build from the code
itself and never committed. `reference/cli.md` comes from the argument parser of
`llamaserve`, `reference/metrics.md` from the Prometheus registry a server builds, so a new
flag or metric is documented without anyone remembering to."""

from __future__ import annotations

import argparse
import os

from mkdocs.config.defaults import MkDocsConfig
from mkdocs.structure.files import File, Files

CLI_PAGE = "reference/cli.md"
METRICS_PAGE = "reference/metrics.md"


def on_files(files: Files, config: MkDocsConfig) -> Files:
    files.append(File.generated(config, CLI_PAGE, content=cli_page()))
    files.append(File.generated(config, METRICS_PAGE, content=metrics_page()))
    return files


def cli_page() -> str:
    from server.startup.cli import build_parser

    # A default read from the environment (the API key) must not reach the page.
    saved = os.environ.pop("LLAMASERVE_API_KEY", None)
    try:
        parser = build_parser()
    finally:
        if saved is not None:
            os.environ["LLAMASERVE_API_KEY"] = saved
    lines = [
        "# Command line",
        "",
        "Generated from `llamaserve`'s argument parser at every build of these pages: what",
        "`llamaserve COMMAND --help` prints, as tables. Flags are named as vLLM names them",
        "where the concept is the same.",
        "",
    ]
    for name, (sub, summary) in _subcommands(parser).items():
        lines += [f"## `llamaserve {name}`", "", f"{summary[:1].upper()}{summary[1:]}.", ""]
        lines += ["| flag | default | meaning |", "|---|---|---|"]
        for action in sub._actions:
            if isinstance(action, argparse._HelpAction):
                continue
            lines.append(f"| {_flag(action)} | {_default(action)} | {_cell(action.help or '')} |")
        lines.append("")
    return "\n".join(lines)


def _subcommands(
    parser: argparse.ArgumentParser,
) -> dict[str, tuple[argparse.ArgumentParser, str]]:
    """Each subcommand's parser and its one-line help."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            helps = {choice.dest: choice.help or "" for choice in action._choices_actions}
            return {name: (sub, helps.get(name, "")) for name, sub in action.choices.items()}
    return {}


def _flag(action: argparse.Action) -> str:
    names = action.option_strings or [action.metavar or action.dest.upper()]
    text = ", ".join(f"`{name}`" for name in names)
    if action.choices:
        text += " " + " \\| ".join(f"`{choice}`" for choice in action.choices)
    return text


def _default(action: argparse.Action) -> str:
    if action.dest == "api_key":
        return "`$LLAMASERVE_API_KEY`"
    if isinstance(action, (argparse._StoreTrueAction, argparse._StoreFalseAction)):
        return "off" if action.default is False else "on"
    if action.default is None or action.default == [] or action.default is argparse.SUPPRESS:
        return ""
    return f"`{action.default}`"


def _cell(text: str) -> str:
    return " ".join(text.replace("|", "\\|").split())


def metrics_page() -> str:
    from server.edge.metrics import ServerMetrics

    metrics = ServerMetrics("MODEL", max_model_len=2048, max_num_batched_tokens=2048)
    lines = [
        "# Metrics",
        "",
        "Generated from the Prometheus registry a server builds, at every build of these pages:",
        "every family `GET /metrics` exports. Counters are exported with a `_total` suffix,",
        "histograms as `_bucket`, `_sum` and `_count`. What the dashboard draws from them:",
        "[Metrics and dashboard](../metrics.md).",
        "",
    ]
    own, runtime = [], []
    for family in metrics.registry.collect():
        labels = sorted({label for sample in family.samples for label in sample.labels} - {"le"})
        row = (
            f"| `{family.name}` | {family.type} | {', '.join(f'`{x}`' for x in labels)} "
            f"| {_cell(family.documentation)} |"
        )
        (own if family.name.startswith("llamaserve:") else runtime).append(row)
    header = ["| name | type | labels | meaning |", "|---|---|---|---|"]
    lines += ["## llamaserve", "", *header, *own, ""]
    lines += ["## Process and Python runtime", "", *header, *runtime, ""]
    return "\n".join(lines)

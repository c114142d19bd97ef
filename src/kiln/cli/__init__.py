"""The ``kiln`` command: the group, and one module per command. Each command imports what it
runs inside its function, so ``kiln --help`` loads no serving stack, torch or grpc."""

import click

from kiln import __version__
from kiln.cli import bench, chat, complete, monitor, optimize, repo, run_batch, serve, trace


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="kiln")
def main() -> None:
    """kiln: optimize, serve and monitor models."""


for _command in (serve.serve, run_batch.run_batch, chat.chat, complete.complete, bench.bench,
                 optimize.optimize, monitor.monitor, trace.trace, repo.repo):  # fmt: skip
    main.add_command(_command)

__all__ = ["main"]

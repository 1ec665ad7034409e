"""`trace-rl`: the LightningCLI entry point (fit, validate, test, predict) with OmegaConf-style YAML."""

from __future__ import annotations

import signal

from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import SIGTERMException

from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule


class TraceCLI(LightningCLI):
    """Links the module's seed into the data module so prompts and rollouts share one seed."""

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 (jsonargparse parser)
        parser.link_arguments("model.seed", "data.seed")


def main(args: list[str] | None = None, run: bool = True) -> TraceCLI:
    return TraceCLI(
        PolicyModule,
        RLDataModule,
        args=args,
        run=run,
        parser_kwargs={"parser_mode": "omegaconf"},
        save_config_kwargs={"overwrite": True},
    )


def entry() -> None:
    """The `trace-rl` console script (returns nothing, so the exit status is 0 on success)."""
    try:
        main()
    except SIGTERMException as stop:  # Lightning leaves with status 0 on SIGTERM; a killed run must not look done
        raise SystemExit(stop.code or 128 + signal.SIGTERM) from stop


if __name__ == "__main__":
    entry()

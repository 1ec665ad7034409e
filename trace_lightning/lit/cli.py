"""`trace-rl`: the LightningCLI entry point (fit, validate, predict) with OmegaConf-style YAML.

A fit logs to runs/<method>-<task>-<model>/version_N and a resume continues its version (lit.runs); `validate`
and `predict` write no run folder unless asked (--log_run true), and `predict` writes JSON lines to stdout; a bad
value or option ends in one line naming it, not a traceback.
"""

from __future__ import annotations

import re
import signal
import sys
import warnings
from typing import Any

from jsonargparse import ArgumentError, DefaultHelpFormatter, set_parsing_settings
from lightning.pytorch.cli import LightningCLI
from lightning.pytorch.utilities.exceptions import MisconfigurationException, SIGTERMException

from trace_lightning.lit.checkpoints import CheckpointFileError, read_checkpoint
from trace_lightning.lit.cli_checks import (
    CLIError,
    check_accelerator,
    check_checkpoint_fits,
    check_group_values,
    check_identity,
    check_precision,
    drop_checkpoint_callbacks,
    explicit_model_keys,
)
from trace_lightning.lit.console import RLProgressBar, RunSummary, quiet_lightning
from trace_lightning.lit.data import RLDataModule
from trace_lightning.lit.policy import PolicyModule
from trace_lightning.lit.runs import place_fit_run, writes_run_folder

DESCRIPTION = """\
trace-rl: FP4 reinforcement learning for Mixture-of-Experts language models (TRACE).

Rollouts run with FP4 weights, activations and KV cache; they record how they rounded, and the training
forward rounds to the same codes, so trainer and rollout policy agree. A run is a supervised warm start
(--model.warmup_steps) followed by GRPO-style RL.

  trace-rl fit --config conf/sim.yaml                      the CPU simulator run (a few minutes)
  trace-rl fit --config conf/sim.yaml --config conf/method/fp4_qat.yaml    another method on top
  trace-rl validate --config conf/sim.yaml --ckpt_path CKPT                eval accuracy of a checkpoint
  trace-rl predict --config conf/sim.yaml --ckpt_path CKPT                 greedy samples as JSON lines

`trace-rl fit --help` lists every setting with its meaning; --print_config shows a run's full config.
"""

SUBCOMMAND_HELP = {
    "fit": "Train: supervised warm start, then RL with FP4 rollouts; logs to runs/<method>-<task>-<model>/version_N "
           "(a resume with --ckpt_path continues its run's version).",
    "validate": "Evaluate a checkpoint: greedy accuracy of the FP4 and the BF16 engine on held-out problems.",
    "predict": "Sample greedily from a checkpoint (--ckpt_path): one JSON line per problem on stdout.",
}


class HelpFormatter(DefaultHelpFormatter):
    """Keeps the line breaks of the descriptions (the command examples read as a list)."""

    def _fill_text(self, text: str, width: int, indent: str) -> str:
        return "".join(indent + line for line in text.splitlines(keepends=True))


PARSER = {"exit_on_error": False, "formatter_class": HelpFormatter}
"""Every parser raises errors (entry() prints them on one line) and keeps description line breaks."""


class TraceCLI(LightningCLI):
    """Links the module's seed into the data module so prompts and rollouts share one seed."""

    @staticmethod
    def subcommands() -> dict[str, set[str]]:
        # `test` is left out: the task's held-out evaluation is `validate`.
        return {name: skip for name, skip in LightningCLI.subcommands().items() if name in SUBCOMMAND_HELP}

    def add_arguments_to_parser(self, parser) -> None:  # noqa: ANN001 (jsonargparse parser)
        parser.link_arguments("model.seed", "data.seed")
        parser.add_argument("--log_run", type=bool, default=False,
                            help="validate / predict: write a run folder (TensorBoard, config.yaml) as fit does")
        lead_help_with_project_options(parser)

    def parse_arguments(self, parser, args) -> None:  # noqa: ANN001 (jsonargparse parser, Lightning's ArgsType)
        self.argv = list(args) if isinstance(args, list | tuple) else sys.argv[1:] if args is None else []
        check_group_values(self.argv)
        super().parse_arguments(parser, args)

    def _parse_ckpt_path(self) -> None:
        """Lightning's merge of a checkpoint's settings into the config, after checking the file (one line for a
        missing, garbage, weights-only or foreign one) and the command line against it: settings that define the
        weights must agree, other explicit --model.* overrides apply over the checkpoint's."""
        subcommand = self.config.get("subcommand")
        path = self.config[subcommand].get("ckpt_path") if subcommand else None
        if not path:
            return
        ckpt = read_checkpoint(path, "--ckpt_path", lightning=True, resume=subcommand == "fit")
        hparams = {k: v for k, v in (ckpt.get("hyper_parameters") or {}).items() if k != "_instantiator"}
        explicit = explicit_model_keys(getattr(self, "argv", []))
        if any(key == "init_from" or key.startswith("init_from.") for key in explicit):
            raise CLIError(f"--model.init_from and --ckpt_path both given: the weights of --ckpt_path {path} would "
                           "replace those of init_from; pass one")
        given = self.config[subcommand].model.clone()
        check_identity(given, hparams, path)
        if hparams:
            try:
                self.config = self.parser.parse_object({subcommand: {"model": hparams}}, self.config)
            except (ArgumentError, SystemExit) as err:
                raise CLIError(f"--ckpt_path {path}: its settings are not trace-rl's (a checkpoint of another "
                               f"model?): {one_line(err)}") from err
        model = self.config[subcommand].model
        for key in explicit:
            if key in given:
                model[key] = given[key]
        model.init_from = None  # the run's start; its weights are replaced by the checkpoint's anyway
        check_checkpoint_fits(model, ckpt, path)

    def before_instantiate_classes(self) -> None:
        config = self.config[self.subcommand] if self.subcommand else self.config
        check_accelerator(config.trainer)
        check_precision(config.trainer)
        drop_checkpoint_callbacks(config.trainer)
        bar = [RLProgressBar()] if config.trainer.get("enable_progress_bar") is not False else []
        self.trainer_defaults["callbacks"] = [*bar, RunSummary()]
        if self.subcommand == "predict":
            check_predict_weights(config)
        if writes_run_folder(self.subcommand, config):
            place_fit_run(config)
        else:  # evaluating or sampling is not a run: no runs/ folder, no config.yaml per call
            config.trainer.logger = False
            self.save_config_callback = None
            # the checkpoint's ModelCheckpoint state names its run folder, which this command does not write to
            warnings.filterwarnings("ignore", message=r"The dirpath has changed from")


USAGE = "%(prog)s [-c CONFIG] [--model.* ...] [--data.* ...] [--trainer.* ...] [--ckpt_path CKPT] [--print_config]"
TRAINER_TITLE = "Lightning Trainer (--trainer.*, Lightning's own flags; conf/*.yaml sets the ones a run needs)"


def lead_help_with_project_options(parser: Any) -> None:
    """`trace-rl fit --help` starts with the project's options (model, trace, rollout, rl, data) and a short usage
    line; Lightning's ~50 trainer flags come after them instead of before."""
    trainer = [g for g in parser._action_groups if any(a.dest == "trainer" for a in g._group_actions)]
    for group in trainer:
        parser._action_groups.remove(group)
        parser._action_groups.append(group)
        group.title = TRAINER_TITLE
    parser.usage = USAGE


def check_predict_weights(config: Any) -> None:
    """Refuse to sample from randomly initialized weights."""
    if not (config.get("ckpt_path") or config.model.get("checkpoint") or config.model.get("init_from")):
        raise CLIError("predict samples from trained weights: pass --ckpt_path CKPT (a trace-rl checkpoint, e.g. "
                       "runs/<run>/version_0/checkpoints/last.ckpt), or --model.checkpoint HF_FOLDER")


def main(args: list[str] | None = None, run: bool = True) -> TraceCLI:
    set_parsing_settings(docstring_parse_attribute_docstrings=True)  # config fields' docstrings in --help
    quiet_lightning()
    return TraceCLI(
        PolicyModule,
        RLDataModule,
        args=args,
        run=run,
        parser_kwargs={"parser_mode": "omegaconf", "description": DESCRIPTION, **PARSER,
                       **{name: {"description": f"{text}\n\n{DESCRIPTION}", **PARSER}
                          for name, text in SUBCOMMAND_HELP.items()}},
        save_config_kwargs={"overwrite": True},
    )


def one_line(err: BaseException) -> str:
    """The error's message on one line (jsonargparse nests causes over several indented lines)."""
    text = re.sub(r"\s*\n\s*", " ", str(err)).strip()
    return text if len(text) <= 400 else text[:397] + "..."


def entry() -> None:
    """The `trace-rl` console script: exit 0 on success, 2 with one line on stderr for a bad value or option, and
    128 + SIGTERM when a fit was killed (Lightning itself leaves with 0 then, and a killed run must not look done)."""
    argv = sys.argv[1:]
    command = "trace-rl" + (f" {argv[0]}" if argv and argv[0] in SUBCOMMAND_HELP else "")
    try:
        main()
    except SIGTERMException as stop:
        raise SystemExit(stop.code or 128 + signal.SIGTERM) from stop
    except (ArgumentError, CLIError, ValueError, MisconfigurationException) as err:
        print(f"{command}: error: {one_line(err)}", file=sys.stderr)
        if not isinstance(err, CLIError | CheckpointFileError):
            print(f"({command} --help lists every option and value)", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    entry()

"""``ckptavg``: plan merges, merge checkpoints, list what a run folder holds.

A thin shell over the library: every command parses its options, calls one function of
``ckptavg`` and prints. User errors print one line and exit 1, usage errors (a bad option value,
an unknown option, a missing argument) too; nothing else is caught.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import json
import os
import re
import sys
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace
from enum import Enum
from typing import Annotated, Any, TypeVar

import typer
from typer.core import TyperGroup

from .errors import CkptavgError, ConfigError
from .plan import Span, plan_from_interval, plan_from_schedule
from .plan.report import render_env, render_json, render_text
from .units import format_bytes, format_count, parse_count, parse_dtype, parse_size
from .version import __version__
from .weighting import Weighting

_ARGV = "ckptavg.argv"  # the command line, in click's context meta, to quote a refused value from
# The exceptions of the click that typer runs on: recent typers carry their own copy
# (typer._click), older ones use click itself. typer exports one of its classes.
_click_errors: Any = sys.modules[typer.BadParameter.__module__]


class _UsageErrorLine(_click_errors.ClickException):
    """A usage error shown as every user error is: one ``ckptavg: error:`` line, exit status 1
    (click's own form is a usage block and exit status 2)."""

    exit_code = 1

    def show(self, file: Any = None) -> None:
        typer.echo(f"ckptavg: error: {self.message}", err=True)


def _given_value(error: Any) -> str | None:
    """The text given to the option ``error`` is about (the last one, as click keeps the last);
    some typer versions leave it out of their message."""
    param = getattr(error, "param", None)
    argv: Sequence[str] = error.ctx.meta.get(_ARGV, ()) if error.ctx is not None else ()
    given = None
    if param is not None and getattr(param, "param_type_name", None) == "option":
        for arg, following in zip(argv, [*argv[1:], None], strict=True):
            for name in param.opts:
                if arg == name and following is not None:
                    given = following
                elif arg.startswith(f"{name}="):
                    given = arg[len(name) + 1 :]
    return given


@contextlib.contextmanager
def _usage_errors_on_one_line() -> Iterator[None]:
    try:
        yield
    except _click_errors.NoArgsIsHelpError as error:
        # A bare `ckptavg` or `ckptavg merge` asks what there is to do: the help answers, exit 0.
        typer.echo(error.ctx.get_help())
        raise typer.Exit(0) from None
    except _click_errors.UsageError as error:
        message = "; ".join(line.strip() for line in error.format_message().splitlines() if line.strip())
        message = message.replace("Value error, ", "")  # pydantic's prefix, under typer >= 0.20
        given = _given_value(error)
        if given is not None and f"'{given}'" not in message:
            message += f" (got '{given}')"
        command = error.ctx.command_path if error.ctx is not None else "ckptavg"
        raise _UsageErrorLine(f"{message} (see {command} --help)") from None


def _name_the_value(param: Any) -> None:
    """Usage and help name a value as the docs do (``RUN_DIR``, ``--window WINDOW``), not by its
    Python type (``{run_dir}``, ``<list[str]>``, ``<int range>``); a choice keeps its choices."""
    if param.metavar is not None or getattr(param, "is_flag", False) or getattr(param, "count", False):
        return
    descriptor = getattr(param, "type_descriptor", None)  # typer >= 0.20; click's type before it
    if getattr(descriptor, "is_choice", False) or hasattr(getattr(param, "type", None), "choices"):
        return
    names = [n for n in getattr(param, "opts", []) if n.startswith("--")]
    param.metavar = (names[0][2:] if names else param.name or "value").upper().replace("-", "_")
    if getattr(param, "param_type_name", None) == "argument":  # RUN_DIR, as docs write it
        param.get_usage_pieces = lambda ctx: [param.metavar]  # not typer's {RUN_DIR}
        param.display_type_rich = lambda ctx: None  # nor its type after it in --help


class _App(TyperGroup):
    """The command group: usage errors of every command become one line (see :class:`_UsageErrorLine`),
    in the real entry point and in anything else that runs the app (typer's test runner)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        for command in self.commands.values():
            for param in command.params:
                _name_the_value(param)

    def parse_args(self, ctx: Any, args: list[str]) -> list[str]:
        ctx.meta[_ARGV] = list(args)  # shared with the commands' contexts
        return super().parse_args(ctx, args)

    def make_context(self, info_name: str | None, args: list[str], parent: Any = None, **extra: Any) -> Any:
        with _usage_errors_on_one_line():  # the group's own options
            return super().make_context(info_name, args, parent, **extra)

    def invoke(self, ctx: Any) -> Any:
        with _usage_errors_on_one_line():  # the command's name and options
            return super().invoke(ctx)


app = typer.Typer(
    name="ckptavg",
    cls=_App,
    no_args_is_help=True,
    help="Average LLM checkpoints over windows of training steps: plan the merges, then "
    "merge the checkpoints of a run folder, streaming, in fp32/fp64, exactly rounded.",
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
)

F = TypeVar("F", bound=Callable[..., Any])


# Local paths the user typed, each after the absolute path the library works with (see say()).
_typed_paths: list[tuple[str, str]] = []


def show_paths_as_typed(*typed: str | None) -> None:
    """From now on, :func:`say` shows these local paths (and paths inside them) as typed."""
    _typed_paths.clear()
    for path in typed:
        if path and "://" not in path:
            absolute = os.path.abspath(path)
            if absolute != path.rstrip("/"):
                _typed_paths.append((absolute, path))
    _typed_paths.sort(key=lambda pair: -len(pair[0]))  # the longest (innermost) place first


def say(text: str, err: bool = False) -> None:
    """Print a line for people: a path under one the user typed is shown as typed
    (``runs/llama/step5000-merged``, not ``/home/me/runs/llama/step5000-merged``), the same in a
    dry run, a merge and an error. The library and JSON output keep absolute paths."""
    for absolute, typed in _typed_paths:
        inside = typed.rstrip("/") + "/"
        text = re.sub(
            re.escape(absolute) + r"(/|(?=[\s:;,'\")]|$))",
            lambda match, typed=typed, inside=inside: inside if match.group(1) else typed,  # type: ignore[misc]
            text,
        )
    typer.echo(text, err=err)


def fail(message: str) -> typer.Exit:
    say(f"ckptavg: error: {message}", err=True)
    return typer.Exit(1)


def user_errors(command: F) -> F:
    """One line on stderr and exit 1 for errors the user can fix; no traceback."""

    @functools.wraps(command)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return command(*args, **kwargs)
        except CkptavgError as exc:
            raise fail(str(exc)) from None
        except Exception as exc:
            # A store that cannot be reached or used (connection refused, unknown host, access
            # denied, no credentials) fails under whatever call met it first: one line all the same.
            from .io.fs import storage_error  # here: fsspec, which `ckptavg plan` starts without

            line = storage_error(exc)
            if line is None:
                raise
            raise fail(f"cannot use the storage: {line}") from None
        except KeyboardInterrupt:
            say("ckptavg: interrupted; nothing was published", err=True)
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _split_commas(values: list[str] | None) -> list[str]:
    items: list[str] = []
    for value in values or []:
        items.extend(v.strip() for v in value.split(",") if v.strip())
    return items


def _describe_steps(steps: list[int]) -> str:
    """``100, 200``; for many, ``125-160 every 5`` when evenly spaced (``4996-5000`` when
    consecutive); a few uneven ones listed, many counted."""
    gaps = {b - a for a, b in itertools.pairwise(steps)}
    if len(steps) <= 3 or (len(gaps) > 1 and len(steps) <= 6):
        return ", ".join(map(str, steps))
    if len(gaps) > 1:
        return f"{steps[0]}-{steps[-1]} ({len(steps)} steps, unevenly spaced)"
    stride = gaps.pop()
    return f"{steps[0]}-{steps[-1]}" + (f" every {stride}" if stride > 1 else "")


def _averaged(sources: list[dict[str, Any]], steps: list[int]) -> tuple[str, str]:
    """What a merge averaged and which steps, for its summary: ``("3 checkpoints", "900, 950,
    1000")``, or for the training hook's blocks ``("4 blocks of 25 steps", "901-1000")``."""
    blocks = [s["block"] for s in sources if "block" in s]
    if not blocks:
        return f"{len(sources)} checkpoints", _describe_steps(steps)
    return f"{len(blocks)} blocks of {blocks[0]['count']} steps", f"{blocks[0]['first_step']}-{blocks[-1]['last_step']}"


def _version(value: bool) -> None:
    if value:
        typer.echo(f"ckptavg {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Average LLM checkpoints over windows of training steps."""


class OutputFormatName(str, Enum):
    safetensors = "safetensors"
    dcp = "dcp"
    pt = "pt"


class PositionsName(str, Enum):
    by_index = "index"
    by_steps = "steps"


class PlanFormat(str, Enum):
    text = "text"
    json = "json"
    env = "env"


@app.command()
@user_errors
def plan(
    window: Annotated[
        str,
        typer.Option(
            "--window",
            help="Steps averaged by each merge (its last step is the merge step); with a suffix, tokens "
            "(80B: the steps that many tokens take, rounded down).",
            callback=lambda value: _check_span(value, "--window", least=1),
        ),
    ],
    periods: Annotated[
        list[str] | None,
        typer.Option(
            "--periods",
            help="Token count of each warmup-stable-decay period, comma-separated or repeated (100B, 2.5T, 4M, 1e9).",
        ),
    ] = None,
    tokens_per_step: Annotated[
        str | None, typer.Option("--tokens-per-step", help="Tokens per optimizer step (e.g. 4M).")
    ] = None,
    batch_size: Annotated[
        int | None,
        typer.Option("--batch-size", help="Sequences per step; with --seq-len instead of --tokens-per-step.", min=1),
    ] = None,
    seq_len: Annotated[int | None, typer.Option("--seq-len", help="Tokens per sequence.", min=1)] = None,
    decay: Annotated[str | None, typer.Option("--decay", help="Decay-phase length of every period, in tokens.")] = None,
    decay_fraction: Annotated[
        float | None, typer.Option("--decay-fraction", help="Decay-phase length as a fraction of each period.")
    ] = None,
    warmup: Annotated[
        str | None,
        typer.Option(
            "--warmup",
            help="Warmup at the start of the run, in steps, or in tokens with a suffix (2B); a window that "
            "reaches into it is warned of, as is one that reaches into a decay phase.",
            callback=lambda value: _check_span(value, "--warmup", least=0),
        ),
    ] = None,
    interval: Annotated[
        int | None,
        typer.Option(
            "--interval",
            help="Instead of periods: merge every N steps (needs --max-steps); --decay or --decay-fraction "
            "then end the run with a decay phase.",
            min=1,
        ),
    ] = None,
    max_steps: Annotated[
        int | None, typer.Option("--max-steps", help="Length of the run in steps, for --interval.", min=1)
    ] = None,
    output_format: Annotated[
        PlanFormat, typer.Option("--format", help="text (table + timeline), json, or env (shell-sourceable).")
    ] = PlanFormat.text,
    png: Annotated[
        str | None,
        typer.Option(
            "--png",
            help="Also draw the plan (learning-rate shape, decay phases, merge steps and windows) "
            "as a PNG at this path or URL; needs matplotlib (pip install 'ckptavg[plot]').",
        ),
    ] = None,
) -> None:
    """Compute merge steps, their windows, and the checkpoint steps the trainer must keep.

    \b
    One merge just before each decay phase of a warmup-stable-decay schedule:
      ckptavg plan --periods 100B,100B --tokens-per-step 4M --decay-fraction 0.1 --window 100
    A window of 20B tokens, and a warning for a window that reaches into the warmup:
      ckptavg plan --periods 100B,100B --tokens-per-step 4M --decay-fraction 0.1 --window 20B --warmup 2B
    A merge every 1000 steps, in a SLURM script:
      eval "$(ckptavg plan --interval 1000 --max-steps 10000 --window 50 --format env)"
    The schedule with its merge windows drawn:
      ckptavg plan --periods 100B,100B --tokens-per-step 4M --decay-fraction 0.1 --window 200 --png plan.png
    """
    tps = None
    if tokens_per_step is not None and (batch_size is not None or seq_len is not None):
        raise ConfigError("give --tokens-per-step or --batch-size with --seq-len, not both")
    if tokens_per_step is not None:
        tps = parse_count(tokens_per_step, "--tokens-per-step")
    elif batch_size is not None or seq_len is not None:
        if batch_size is None or seq_len is None:
            raise ConfigError("--batch-size and --seq-len go together")
        tps = batch_size * seq_len
    period_values = _split_commas(periods)
    if interval is not None:
        if period_values:
            raise ConfigError("give --periods or --interval, not both")
        if max_steps is None:
            raise ConfigError("--interval needs --max-steps")
    elif not period_values:
        raise ConfigError("give --periods (with --tokens-per-step) or --interval (with --max-steps)")
    elif tps is None:
        raise ConfigError("--periods needs --tokens-per-step (or --batch-size and --seq-len)")
    window_span = Span.parse(window, "--window")
    window_steps = window_span.steps(tps, "--window")
    if window_steps < 1:
        raise ConfigError(f"--window {window} is less than one step of {format_count(tps or 0)} tokens")
    decay_tokens = None if decay is None else parse_count(decay, "--decay")
    warmup_steps = 0 if warmup is None else Span.parse(warmup, "--warmup").steps(tps, "--warmup", round_up=True)
    if interval is not None:
        assert max_steps is not None
        result = plan_from_interval(interval, max_steps, window_steps, tps, decay_tokens, decay_fraction, warmup_steps)
    else:
        assert tps is not None
        lengths = [parse_count(p, "--periods") for p in period_values]
        result = plan_from_schedule(lengths, tps, window_steps, decay_tokens, decay_fraction, warmup_steps)
    if window_span.tokens:
        result = replace(result, window_tokens=window_span.count)
    if png is not None:
        # Drawn before printing: a failed PNG must not leave `eval "$(... --format env)"`
        # with variables from a command that exits 1.
        from .plan.plot import render_png  # here: it imports fsspec, which `ckptavg plan` needs for a PNG only

        render_png(result, png)
    _warn_of(result.warnings())
    render = {PlanFormat.text: render_text, PlanFormat.json: render_json, PlanFormat.env: render_env}
    say(render[output_format](result))


# Warnings printed at most: a merge every few steps inside a long decay would flood the terminal.
MAX_PLAN_WARNINGS = 10


def _warn_of(warnings: list[str]) -> None:
    """A plan's warnings, one line each on stderr; past :data:`MAX_PLAN_WARNINGS`, one line more
    counts the rest (``--format json`` lists them all)."""
    for text in warnings[:MAX_PLAN_WARNINGS]:
        say(f"ckptavg: warning: {text}", err=True)
    if len(warnings) > MAX_PLAN_WARNINGS:
        more = len(warnings) - MAX_PLAN_WARNINGS
        say(f"ckptavg: warning: and {more} more windows that reach into the warmup or a decay phase", err=True)


def _check_span(value: str | None, option: str, least: int) -> str | None:
    """An option callback: a length in steps or tokens (:class:`~ckptavg.plan.Span`) checked when
    parsed, so that a malformed one is a usage error naming the option."""
    if value is not None:
        try:
            span = Span.parse(value, option)
        except CkptavgError as exc:
            raise typer.BadParameter(str(exc), param_hint=f"'{option}'") from None
        if span.count < least:
            raise typer.BadParameter(f"must be at least {least} (got '{value}')", param_hint=f"'{option}'")
    return value


@app.command()
@user_errors
def merge(
    run_dir: Annotated[
        str,
        typer.Argument(
            help="Run folder holding the checkpoints: stepN/, iter_N/, global_stepN/ folders or .ckpt files "
            "(path or fsspec URL)."
        ),
    ],
    merge_step: Annotated[
        int | None,
        typer.Option("--merge-step", help="Last step of the window (the merge step); with --window.", min=0),
    ] = None,
    window: Annotated[
        str | None,
        typer.Option(
            "--window",
            help="Window length in steps: averages every checkpoint in [S-N+1, S] (or the training hook's "
            "stepN-block/ folders that tile it, where they hold more of its steps). Several, comma-separated "
            "(50,100,200): one output per window, all from one read of the widest.",
            callback=lambda value: _check_list(value, _windows, "--window"),
        ),
    ] = None,
    last: Annotated[
        int | None, typer.Option("--last", help="Average the newest K complete checkpoints.", min=1)
    ] = None,
    steps: Annotated[
        str | None, typer.Option("--steps", help="Average exactly these steps, e.g. 900,950,1000.")
    ] = None,
    every: Annotated[
        int | None,
        typer.Option(
            "--every",
            help="Save stride inside the window: the merge step and every K-th step before it must be there "
            "(default: the gcd of the gaps between the steps found in the window).",
            min=1,
        ),
    ] = None,
    allow_partial_window: Annotated[
        bool,
        typer.Option(
            "--allow-partial-window",
            help="Average a window that misses steps (a warning names them) instead of refusing it.",
        ),
    ] = False,
    min_gap: Annotated[
        int | None,
        typer.Option(
            "--min-gap",
            help="Average only checkpoints at least N steps apart: walking back from the merge step (with "
            "--last: the newest), which is always kept (Megatron's --min-iteration-interval).",
            min=1,
        ),
    ] = None,
    weighting: Annotated[
        str | None,
        typer.Option(
            "--weighting",
            help="uniform (SMA, default); ema (with --ema-alpha or --ema-halflife, in training steps); "
            "wma (the i-th of n checkpoints weighs i); wsm:SHAPE (the average acts like a decay of SHAPE over "
            "the window: linear, 1-sqrt, cosine, poly:P; Megatron's coefficients; :reverse reverses them, "
            "wsm:1-sqrt:reverse); minus-sqrt (wsm:1-sqrt). Weights are normalised and recorded in the manifest. "
            "Several, comma-separated (uniform,wsm:1-sqrt): one output per weighting (and window), all from one read.",
            callback=lambda value: _check_list(value, _weighting_names, "--weighting"),
        ),
    ] = None,
    ema_alpha: Annotated[
        float | None,
        typer.Option("--ema-alpha", help="EMA: weight of the newest step; earlier steps decay by 1-alpha each step."),
    ] = None,
    ema_halflife: Annotated[
        float | None, typer.Option("--ema-halflife", help="EMA: steps after which a step's weight halves.")
    ] = None,
    positions: Annotated[
        PositionsName | None,
        typer.Option(
            "--positions",
            help="wsm: place the checkpoints in the decay by their place in the window (index, Megatron's) or "
            "by their training steps (steps: x_i = (N-1)(s_i-s_0) / (N(s_last-s_0)); evenly spaced steps give the "
            "index weights).",
        ),
    ] = None,
    weights: Annotated[
        str | None,
        typer.Option(
            "--weights", help="Explicit weights, one per averaged checkpoint, in ascending step order: 1,2,4."
        ),
    ] = None,
    allow_negative_weights: Annotated[
        bool,
        typer.Option(
            "--allow-negative-weights",
            help="Let --weights be negative (extrapolation, subtractive merges: 2,-1); their sum must not be zero. "
            "Such sums are taken in fp64, compensated: within one ulp of the exact weighted sum.",
        ),
    ] = False,
    copy: Annotated[
        list[str] | None,
        typer.Option(
            "--copy",
            help="Copy the tensors matching these globs (output names; comma-separated or repeated) from one "
            "source instead of averaging them, even where the sources differ: '*.expert_bias', '*._extra_state'.",
        ),
    ] = None,
    copy_from: Annotated[
        str,
        typer.Option("--copy-from", help="The source --copy takes from: newest, oldest, or a step of the window."),
    ] = "newest",
    out: Annotated[
        str | None,
        typer.Option(
            "--out",
            help="Output folder (default RUN_DIR/stepS-merged). With several windows or weightings: the folder "
            "that holds the outputs (default RUN_DIR), named stepS-merged-w<W>-<tag> (one window: stepS-merged-<tag>).",
        ),
    ] = None,
    dtype: Annotated[
        str | None,
        typer.Option("--dtype", help="Output dtype of floating tensors: bf16, fp16, fp32, fp64 (default: as input)."),
    ] = None,
    shard_size: Annotated[str, typer.Option("--shard-size", help="Largest output shard (5GB, 500MB, 2GiB).")] = "5GB",
    force: Annotated[
        bool, typer.Option("--force", help="Replace an existing output folder (with several: every one).")
    ] = False,
    resume: Annotated[
        bool,
        typer.Option(
            "--resume",
            help="Pick up an interrupted run of this merge: reuse its finished files (sha256 checked), redo the rest. "
            "With several windows or weightings, outputs the interrupted run already published are kept.",
        ),
    ] = False,
    no_fsync: Annotated[
        bool,
        typer.Option(
            "--no-fsync",
            help="Do not fsync the output before publishing it (faster; a power loss may then leave a "
            "complete-looking output whose bytes never reached the disk).",
        ),
    ] = False,
    allow_nonfinite: Annotated[
        bool, typer.Option("--allow-nonfinite", help="Average NaN/Inf values instead of refusing them.")
    ] = False,
    remove_consumed_snapshots: Annotated[
        bool,
        typer.Option(
            "--remove-consumed-snapshots",
            help="Once the output is published, synced and verified, remove the training hook's stepN-snapshot/ "
            "folders it averaged; trainer checkpoints are always kept.",
        ),
    ] = False,
    dry_run: Annotated[
        bool, typer.Option("--dry-run", help="Show what would be averaged and read; write nothing.")
    ] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress and no summary line.")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
    workers: Annotated[int, typer.Option("--workers", help="Reader threads.", min=1)] = 2,
    threads: Annotated[
        int | None,
        typer.Option(
            "--threads",
            help="Arithmetic threads [default: the cores this process may use, divided among the "
            "processes of a torchrun/srun merge on its node].",
            show_default=False,
        ),
    ] = None,
    use_mmap: Annotated[
        bool,
        typer.Option(
            "--mmap",
            help="Read local files in place through memory mappings instead of copying them in "
            "(slower on the machines measured; a file truncated during the merge then crashes it).",
        ),
    ] = False,
    chunk_size: Annotated[
        str,
        typer.Option(
            "--chunk-size",
            help="Accumulator bytes per chunk; bounds memory (at most 9 chunks in use per output, however "
            "many inputs; at most 1GiB and what memory holds).",
        ),
    ] = "16MiB",
    output_format: Annotated[
        OutputFormatName,
        typer.Option(
            "--format",
            help="Output: safetensors (Hugging Face shards + index), dcp (torch.distributed.checkpoint, "
            "loadable by the trainer; OLMo-core runs get model_and_optim/), pt (pytorch_model*.bin + index).",
        ),
    ] = OutputFormatName.safetensors,
    include: Annotated[
        list[str] | None,
        typer.Option(
            "--include",
            help="Average only keys matching these globs (comma-separated or repeated), instead of the "
            "model weights chosen by default; e.g. 'optim.state.*.exp_avg' to average optimizer moments too.",
        ),
    ] = None,
    exclude: Annotated[list[str] | None, typer.Option("--exclude", help="Leave out keys matching these globs.")] = None,
    strip_prefix: Annotated[
        str,
        typer.Option("--strip-prefix", help="Remove this prefix from output key names, e.g. 'model.' for HF names."),
    ] = "",
) -> None:
    """Average the checkpoints of one window into a new checkpoint.

    Reads safetensors (Hugging Face), DCP (OLMo-core, torchtitan, Megatron-core,
    torch.distributed.checkpoint), DeepSpeed ZeRO 0-3 folders, Lightning .ckpt files and
    torch.save .pt/.bin checkpoints, from a local folder or any fsspec URL (s3://, gs://,
    memory://). Only model weights are averaged unless --include says otherwise.

    \b
    Window of the last 100 steps before step 5000:
      ckptavg merge runs/llama --merge-step 5000 --window 100
    The newest 4 checkpoints, written as bf16 to a chosen folder:
      ckptavg merge runs/llama --last 4 --dtype bf16 --out merged/
    An OLMo-core run on S3, merged to a DCP folder OLMo-core can load:
      ckptavg merge s3://bucket/run --merge-step 5000 --window 100 --format dcp
    torchtitan weights to Hugging Face-style names:
      ckptavg merge runs/titan --last 3 --strip-prefix model.
    An EMA with a half-life of 20 steps over the window, weights shown first:
      ckptavg merge runs/llama --merge-step 5000 --window 100 --ema-halflife 20 --dry-run
    What would be read, without reading it:
      ckptavg merge runs/llama --steps 4900,4950,5000 --dry-run
    Three windows x two weightings, six outputs from one read of the widest window
    (runs/llama/step5000-merged-w50-uniform, ...-w200-ema20); --dry-run shows the saving:
      ckptavg merge runs/llama --merge-step 5000 --window 50,100,200 --weighting uniform,ema --ema-halflife 20
    """
    show_paths_as_typed(run_dir, out)
    # Here, not at the top: torch, which `ckptavg plan` starts without.
    from .merging.api import merge as merge_selection
    from .merging.api import select
    from .merging.keys import KeyFilter
    from .merging.options import MergeOptions, copy_source

    shard_bytes, chunk_bytes = parse_size(shard_size, "--shard-size"), parse_size(chunk_size, "--chunk-size")
    # Built (and so checked) before any listing, so that --dry-run refuses a bad size too.
    options = MergeOptions(
        shard_size=shard_bytes,
        chunk_bytes=chunk_bytes,
        workers=workers,
        threads=threads,
        mmap=use_mmap,
        output_format=output_format.value,
        keys=KeyFilter(tuple(_split_commas(include)), tuple(_split_commas(exclude)), strip_prefix),
        allow_nonfinite=allow_nonfinite,
        force=force,
        resume=resume,
        fsync=not no_fsync,
        remove_consumed_snapshots=remove_consumed_snapshots,
        copy=tuple(_split_commas(copy)),
        copy_from=copy_source(copy_from, "--copy-from"),
    )
    explicit = None
    if weights is not None:
        try:
            explicit = [float(w) for w in _split_commas([weights])]
        except ValueError as exc:
            raise ConfigError(f"--weights must be comma-separated numbers, got {weights!r}") from exc
    windows = None if window is None else _windows(window)
    names = None if weighting is None else _weighting_names(weighting)
    place = None if positions is None else positions.value
    if names is None:
        schemes = [Weighting.from_options(None, ema_alpha, ema_halflife, explicit, allow_negative_weights, place)]
    else:
        # --ema-* go to the ema weighting and --positions to the wsm ones; with none of those in
        # the list, Weighting refuses them by name.
        ema = "ema" in names
        wsm = any(name.startswith("wsm:") for name in names)
        schemes = [
            Weighting.from_options(
                name,
                *((ema_alpha, ema_halflife) if name == "ema" or not ema else (None, None)),
                explicit,
                allow_negative_weights,
                place if name.startswith("wsm:") or not wsm else None,
            )
            for name in names
        ]

    step_list = None
    if steps is not None:
        try:
            step_list = [int(s) for s in _split_commas([steps])]
        except ValueError as exc:
            raise ConfigError(f"--steps must be comma-separated integers, got {steps!r}") from exc
    if len(windows or [None]) * len(schemes) > 1:
        _sweep(
            run_dir,
            merge_step=merge_step,
            windows=windows,
            weightings=schemes,
            last=last,
            steps=step_list,
            out=out,
            every=every,
            allow_partial_window=allow_partial_window,
            min_gap=min_gap,
            options=options,
            dtype=dtype,
            dry_run=dry_run,
            quiet=quiet,
            as_json=as_json,
        )
        return
    scheme = schemes[0]

    def choose() -> Any:
        return select(
            run_dir,
            merge_step=merge_step,
            window=None if windows is None else windows[0],
            last=last,
            steps=step_list,
            out=out,
            every=every,
            allow_partial_window=allow_partial_window,
            min_gap=min_gap,
        )

    def work(selection: Any, options: MergeOptions, progress: Any, collective: Any, notice: Any) -> Any:
        return merge_selection(
            run_dir,
            selection=selection,
            weighting=scheme,
            options=options,
            progress=progress,
            collective=collective,
            notice=notice,
        )

    done = _run_collectively(
        choose,
        lambda selection: [selection.missing] if selection.missing else [],
        lambda selection, options: _print_dry_run(selection, options, scheme, as_json, quiet),
        work,
        options=options,
        dtype=dtype,
        dry_run=dry_run,
        quiet=quiet,
    )
    if done is None:
        return
    selection, result, collective = done
    chosen_steps = [c.step for c in selection.checkpoints]
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    if quiet:
        return
    if not result.already_merged:  # that one a note has told
        processes = f" by {collective.world_size} processes" if collective.world_size > 1 else ""
        counts = [(result.reused_files, "file"), (result.reused_ranges, "byte range")]
        finished = [f"{n} {what}{'' if n == 1 else 's'}" for n, what in counts if n]
        if finished:
            processes += f", reusing {' and '.join(finished)} of the interrupted run"
        what, which = _averaged(result.sources, chosen_steps)
        say(
            f"ckptavg: merged {what} (steps {which}, {result.tensor_count} tensors) into "
            f"{result.output}{processes}: read {format_bytes(result.bytes_read)} in {result.seconds:.2f} s "
            f"({result.read_gb_per_s:.2f} GB/s)",
            err=True,
        )
    if remove_consumed_snapshots:
        say(f"ckptavg: {_describe_removal(result.removed_snapshots, result.kept_inputs)}", err=True)


WEIGHTING_NAMES = ("uniform", "ema", "wma", "minus-sqrt")  # explicit weights come with --weights; wsm:SHAPE


def _check_list(value: str | None, parse: Callable[[str], Any], option: str) -> str | None:
    """An option callback: a list option's value checked when parsed (a usage error names it)."""
    if value is not None:
        try:
            parse(value)
        except ValueError as exc:
            raise typer.BadParameter(f"{exc} (got '{value}')", param_hint=f"'{option}'") from None
    return value


def _windows(value: str) -> list[int]:
    """``50,100,200`` -> [50, 100, 200]: window lengths, each at least 1 step."""
    try:
        windows = [int(v) for v in _split_commas([value])]
    except ValueError:
        raise ValueError("a window is a whole number of steps; several are comma-separated: 50,100,200") from None
    if not windows or min(windows) < 1:
        raise ValueError("every window must be at least 1 step")
    return windows


def _weighting_names(value: str) -> list[str]:
    """``uniform,wsm:1-sqrt`` -> ["uniform", "wsm:1-sqrt"]; a wsm shape is checked here."""
    names = _split_commas([value])
    unknown = [n for n in names if n not in WEIGHTING_NAMES and not n.startswith("wsm:")]
    if not names or unknown:
        listed = ", ".join(f"'{n}'" for n in WEIGHTING_NAMES)
        raise ValueError(
            f"'{(unknown or [value])[0]}' is not one of {listed}, 'wsm:SHAPE'; several are comma-separated: uniform,ema"
        )
    for name in names:
        if name.startswith("wsm:"):
            try:
                Weighting.parse(name)
            except ConfigError as exc:
                raise ValueError(str(exc)) from None
    return names


def _run_collectively(
    choose: Callable[[], Any],
    missing: Callable[[Any], list[str]],
    show_dry_run: Callable[[Any, Any], None],
    work: Callable[[Any, Any, Any, Any, Callable[[str], None] | None], Any],
    *,
    options: Any,
    dtype: str | None,
    dry_run: bool,
    quiet: bool,
) -> tuple[Any, Any, Any] | None:
    """What a merge and a sweep share around their work: join the other processes (torchrun,
    srun), let process 0 choose the checkpoints for all, warn of partial windows, stop at
    ``--dry-run`` (``show_dry_run(selection, options)``), else run ``work(selection, options,
    progress, collective, notice)``. Returns
    ``(selection, result, collective)`` to process 0 for its report, None otherwise."""
    # Here, not at the top: torch, which `ckptavg plan` starts without.
    from .merging.distributed import Collective, TorchCollective, launch_from_environment
    from .merging.progress import ByteProgress

    launch = launch_from_environment()
    collective = TorchCollective(launch) if launch is not None else Collective()
    all_done = False
    try:
        # Process 0 chooses, so that every process merges the same checkpoints even if a
        # listing changes while they start.
        selection = collective.decide(choose)
        if collective.rank == 0 and not quiet:
            for text in missing(selection):
                say(f"ckptavg: warning: partial window: it misses {text}", err=True)
        if dtype is not None:  # after the listing, whose errors come first; --dry-run needs it too
            options = replace(options, dtype=parse_dtype(dtype, "--dtype"))
        if dry_run:
            if collective.rank == 0:
                show_dry_run(selection, options)
            all_done = True
            return None
        if launch is not None and not quiet:
            say(f"ckptavg: {collective.prefix}joined ({launch.launcher}, master {launch.master_addr})", err=True)
        notice = None if quiet else (lambda text: say(f"ckptavg: note: {text}", err=True))
        with ByteProgress(0, quiet=quiet, label=f"{collective.prefix}merge") as progress:
            result = work(selection, options, progress, collective, notice)
        all_done = True
    finally:
        collective.close(all_done)
    return (selection, result, collective) if collective.rank == 0 else None


def _sweep(
    run_dir: str,
    *,
    merge_step: int | None,
    windows: list[int] | None,
    weightings: list[Weighting],
    last: int | None,
    steps: list[int] | None,
    out: str | None,
    every: int | None,
    allow_partial_window: bool,
    min_gap: int | None,
    options: Any,
    dtype: str | None,
    dry_run: bool,
    quiet: bool,
    as_json: bool,
) -> None:
    """``merge`` with several windows or weightings: one pass, one output per candidate."""
    # Here, not at the top: torch, which `ckptavg plan` starts without.
    from .merging.api import select_sweep, sweep
    from .merging.sweep import check_memory

    if options.remove_consumed_snapshots:
        raise ConfigError(
            "--remove-consumed-snapshots removes the inputs of a single merge, not of several windows or weightings"
        )
    count = len(windows or [None]) * len(weightings)
    check_memory(count, options.chunk_bytes)

    def choose() -> Any:
        return select_sweep(
            run_dir,
            merge_step=merge_step,
            windows=windows,
            weightings=weightings,
            last=last,
            steps=steps,
            out=out,
            every=every,
            allow_partial_window=allow_partial_window,
            min_gap=min_gap,
        )

    def work(selection: Any, options: Any, progress: Any, collective: Any, notice: Any) -> Any:
        return sweep(
            run_dir, selection=selection, options=options, progress=progress, collective=collective, notice=notice
        )

    done = _run_collectively(
        choose,
        lambda selection: list(dict.fromkeys(c.missing for c in selection.candidates if c.missing)),
        lambda selection, options: _print_sweep_dry_run(selection, options, as_json),
        work,
        options=options,
        dtype=dtype,
        dry_run=dry_run,
        quiet=quiet,
    )
    if done is None:
        return
    selection, result, collective = done
    if as_json:
        typer.echo(json.dumps(result.to_dict(), indent=2))
        return
    if quiet:
        return
    for candidate, merged in zip(selection.candidates, result.candidates, strict=True):
        kept = " (kept: already merged, manifest matches)" if merged.output in result.kept else ""
        what, which = _averaged(merged.sources, [c.step for c in candidate.checkpoints])
        say(
            f"ckptavg: {merged.output}: {what} (steps {which}), {candidate.weighting.tag()}{kept}",
            err=True,
        )
    processes = f" by {collective.world_size} processes" if collective.world_size > 1 else ""
    say(
        f"ckptavg: merged {len(result.candidates)} candidates in one pass{processes}: read "
        f"{format_bytes(result.bytes_read)} once instead of {format_bytes(result.bytes_separately)} by separate "
        f"merges, in {result.seconds:.2f} s",
        err=True,
    )


def _print_sweep_dry_run(selection: Any, options: Any, as_json: bool) -> None:
    # Here, not at the top: torch and fsspec, which `ckptavg plan` starts without.
    from .io.fs import redact
    from .merging.api import already_merged, sweep_read_bytes
    from .merging.sweep import sweep_memory

    per_source, tensor_count = sweep_read_bytes(selection, options.keys)
    once = per_source * len(selection.checkpoints)
    separately = per_source * sum(len(c.checkpoints) for c in selection.candidates)
    memory = sweep_memory(len(selection.candidates), options.chunk_bytes)
    candidates = []
    for c in selection.candidates:
        steps = [k.step for k in c.checkpoints]
        candidates.append(
            {
                "name": c.name,
                "output": redact(c.output),
                "window": c.window,
                "weighting": c.weighting.describe(),
                "steps": steps,
                "weights": c.weighting.weights(steps),
                "missing": c.missing,
                "already_merged": already_merged(c.checkpoints, c.output, c.weighting, options),
            }
        )
    payload = {
        "run_dir": selection.run_dir,
        "merge_step": selection.merge_step,
        "steps_read": [c.step for c in selection.checkpoints],
        "candidates": candidates,
        "tensor_count": tensor_count,
        "bytes_to_read": once,
        "bytes_by_separate_merges": separately,
        "buffer_bytes": memory,
    }
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    say(
        f"would write {len(candidates)} candidates from one read of {len(selection.checkpoints)} checkpoints "
        f"(steps {_describe_steps(payload['steps_read'])}):"
    )
    width = max(len(c["name"]) for c in candidates)
    for c in candidates:
        weights = " ".join(f"{w:.4f}" for w in c["weights"][-6:])
        more = "... " if len(c["weights"]) > 6 else ""
        kept = " (already merged, manifest matches: kept)" if c["already_merged"] else ""
        say(
            f"  {c['name']:<{width}}  {len(c['steps']):>4} checkpoints (steps {_describe_steps(c['steps'])}), "
            f"weights {more}{weights}{kept}"
        )
    say(
        f"{tensor_count} tensors each; {format_bytes(once)} to read once, instead of {format_bytes(separately)} "
        f"by {len(candidates)} separate merges ({separately / max(once, 1):.1f}x); buffers {format_bytes(memory)}"
    )


def _describe_removal(removed: list[str], kept: list[str], would: bool = False) -> str:
    """One line: which inputs the merge removed (snapshots) and which it kept."""
    remove, keep = ("would remove", "would keep") if would else ("removed", "kept")
    line = f"{remove} {len(removed)} consumed snapshot(s)" + (f": {', '.join(removed)}" if removed else "")
    return line + (f"; {keep} {len(kept)} other input(s): {', '.join(kept)}" if kept else "")


def _exists(url: str) -> bool:
    from .io.fs import resolve  # here, not at the top: fsspec, which `ckptavg plan` starts without

    fs, path = resolve(url)
    return bool(fs.exists(path))


def _print_dry_run(selection: Any, options: Any, scheme: Any, as_json: bool, quiet: bool) -> None:
    # Here, not at the top: torch and fsspec, which `ckptavg plan` starts without.
    from .io.fs import redact, resolve
    from .merging.api import already_merged, read_bytes
    from .merging.job import already_merged_note
    from .merging.retention import is_snapshot

    total, tensor_count = read_bytes(selection, options.keys)
    merged = already_merged(selection.checkpoints, selection.output, scheme, options)
    if merged and not quiet:  # the note the merge itself would give
        say(f"ckptavg: note: {already_merged_note(redact(selection.output))}", err=True)
    elif not quiet and _exists(selection.output):
        shown = redact(selection.output)
        what = (
            "already exists: the run would replace it once the new one is complete (--force)"
            if options.force
            else "already exists, and is not this merge: the run would refuse it (--force replaces it)"
        )
        say(f"ckptavg: note: {shown} {what}", err=True)
    weights = scheme.weights([c.step for c in selection.checkpoints])
    payload = {
        "run_dir": selection.run_dir,
        "output": redact(selection.output),
        "merge_step": selection.merge_step,
        "weighting": scheme.describe(),
        "sources": [
            {"step": c.step, "path": c.url, "format": c.format, "weight": w}
            for c, w in zip(selection.checkpoints, weights, strict=True)
        ],
        "missing": selection.missing,
        "tensor_count": tensor_count,
        "bytes_to_read": total,
        "already_merged": merged,
    }
    removable: list[str] = []
    if options.remove_consumed_snapshots:
        removable = [c.url for c in selection.checkpoints if is_snapshot(*resolve(c.url))]
        payload["would_remove"] = removable
    if as_json:
        typer.echo(json.dumps(payload, indent=2))
        return
    noun = "blocks" if all(c.block for c in selection.checkpoints) else "checkpoints"
    say(f"would average {len(selection.checkpoints)} {noun} ({scheme.scheme} weights) into {redact(selection.output)}:")
    for c, w in zip(selection.checkpoints, weights, strict=True):
        say(f"  step {c.step:>10}  weight {w:.4f}  {c.format:<12} {c.url}")
    say(f"{tensor_count} tensors each; {format_bytes(total)} to read")
    if options.remove_consumed_snapshots:
        kept = [c.url for c in selection.checkpoints if c.url not in removable]
        say(f"once the output is verified: {_describe_removal(removable, kept, would=True)}")


@app.command()
@user_errors
def verify(
    output: Annotated[str, typer.Argument(help="A merged output folder (path or fsspec URL).")],
    against: Annotated[
        str | None,
        typer.Option("--against", help="Run folder holding the sources: recompute a sample of tensors and compare."),
    ] = None,
    sample: Annotated[int, typer.Option("--sample", help="Tensors recomputed with --against.", min=1)] = 8,
    as_json: Annotated[bool, typer.Option("--json", help="Print the report as JSON on stdout.")] = False,
) -> None:
    """Check a merged output: manifest, every file's sha256, tensors against the index and the
    manifest, finiteness; with --against, recompute a sample of tensors from the sources.

    \b
      ckptavg verify runs/llama/step5000-merged
      ckptavg verify runs/llama/step5000-merged --against runs/llama --sample 16
    Exit status 1 and one line naming the file or tensor on the first problem.
    """
    show_paths_as_typed(output, against)
    from .merging.verify import verify as run_verify  # here, not at the top: torch, as for merge

    report = run_verify(output, against=against, sample=sample)
    if as_json:
        typer.echo(json.dumps(report.to_dict(), indent=2))
        return
    recomputed = f"; {len(report.recomputed)} tensors recomputed from the sources: identical" if against else ""
    say(
        f"ckptavg: {report.output} verified: {report.files_checked} files match the manifest, "
        f"{report.tensors_checked} tensors consistent and finite{recomputed}"
    )


@app.command("ls")
@user_errors
def list_checkpoints(
    run_dir: Annotated[str, typer.Argument(help="Run folder (path or fsspec URL).")],
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
) -> None:
    """List the checkpoints of a run folder (step folders, checkpoint files): step, format, size,
    complete or not.

    \b
      ckptavg ls runs/llama
    """
    show_paths_as_typed(run_dir)
    # Here, not at the top: torch and fsspec, which `ckptavg plan` starts without.
    from .io.fs import folder_size, redact, resolve
    from .merging.discovery import find_checkpoints

    fs, path = resolve(run_dir)
    rows: list[dict[str, Any]] = []
    for c in find_checkpoints(fs, path):
        if c.merged:
            status = "merged"
        elif not c.complete:
            status = f"incomplete: {c.note}"
        else:
            status = f"same save as {c.same_as}" if c.same_as else "complete"
        rows.append(
            {
                "step": c.step,
                "name": c.name,
                "format": c.format,
                "bytes": folder_size(fs, c.path),
                "status": status,
                "path": c.url,
            }
        )
    if as_json:
        typer.echo(json.dumps(rows, indent=2))
        return
    if not rows:
        say(f"no checkpoints (stepN, step-N, checkpoint-N, global_stepN folders; *.ckpt files) in {redact(run_dir)}")
        return
    table = [("step", "name", "format", "size", "status")] + [
        (str(r["step"]), r["name"], r["format"] or "-", format_bytes(r["bytes"]), r["status"]) for r in rows
    ]
    widths = [max(len(row[i]) for row in table) for i in range(5)]
    for row in table:
        say("  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)).rstrip())


def main() -> None:
    # torch warns on import when numpy is not installed (it does not need numpy, nor does ckptavg,
    # which never converts a tensor to an array): the command prints only its own lines.
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    app(prog_name="ckptavg")

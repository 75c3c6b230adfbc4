"""The examples of README.md and docs/*.md, run as tests (Sybil; collected by the repository's
``conftest.py``, so ``pytest --collect-only`` lists ``README.md::line:54,column:1`` and the like).

Why Sybil: it parses Markdown fences and HTML-comment directives, keeps one namespace per page
(the ``python`` blocks of a page run in order and share their names), reports each block as a
pytest item, and its ``<!-- skip: next "reason" -->`` directive turns what cannot run here into a
pytest skip with that reason, counted in the summary. pytest-markdown-docs runs Python blocks only.

Each page runs in a sandbox folder of its own (the working folder while its examples run) that
holds the tiny runs its examples name (``runs/llama``: 291 tensors at steps 4610-5000 every 10,
...), built by the page's ``setup``. What each kind of block must do:

- ``python``: run without an exception. Names a page uses but does not define (a user's model,
  optimizer, ``train_step``) come from an ``<!-- invisible-code-block: python -->`` in the page
  itself, so a reader can see what they stand for.
- ``console``: each ``$ command`` runs (a block with any shell syntax in one ``bash``, so ``eval``
  and variables carry over), stdout and stderr together; its output must match the lines shown
  below it. A line
  ``...`` stands for any number of lines, ``...`` inside a line for any text; sizes, durations
  and rates are compared as ``<size>``, ``<seconds>`` and ``<rate>``.
- ``bash``: every command of the block must succeed.

A plain ``ckptavg ...`` command runs in this process (the command line's own app, as the CLI
tests run it): a new interpreter would cost ~2 s of imports per command.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from helpers import REPO, run_cli_in_process, write_checkpoint
from sybil import Example, Sybil
from sybil.integration.pytest import pytest_integration
from sybil.parsers.markdown import ClearNamespaceParser, CodeBlockParser, PythonCodeBlockParser, SkipParser

SANDBOX = "_sandbox"  # the page's sandbox folder, kept in its namespace

# -- the runs the examples name --------------------------------------------------------------------

LLAMA_LAYERS = 32  # 9 tensors a layer + embeddings, final norm and head: 291 tensors, as docs show
LLAMA_STEPS = range(4610, 5001, 10)


def llama_tensors(step: int) -> dict[str, torch.Tensor]:
    """A Llama-shaped state dict of tiny bf16 tensors whose values drift with the step."""
    names = ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
    for layer in range(LLAMA_LAYERS):
        prefix = f"model.layers.{layer}."
        names += [prefix + f"self_attn.{p}_proj.weight" for p in "qkvo"]
        names += [prefix + f"mlp.{p}_proj.weight" for p in ("gate", "up", "down")]
        names += [prefix + "input_layernorm.weight", prefix + "post_attention_layernorm.weight"]
    generator = torch.Generator().manual_seed(step)
    return {name: (torch.randn(8, 4, generator=generator) * 0.02 + i * 1e-3).bfloat16() for i, name in enumerate(names)}


def write_llama_run(folder: Path, steps: Iterable[int] = LLAMA_STEPS) -> None:
    for step in steps:
        write_checkpoint(folder / f"step{step}", llama_tensors(step), shards=2, config={"model_type": "llama"})


def write_moe_run(folder: Path, steps: list[int]) -> None:
    """A MoE router's checkpoints: bf16 weights, and an ``expert_bias`` and a token counter that
    change at every step (set by rule, not by gradients)."""
    for step in steps:
        router = "layers.0.mlp.router."
        tensors = {
            router + "weight": torch.full((4, 8), step / 1000).bfloat16(),
            router + "expert_bias": torch.full((4,), step / 10_000),
            router + "tokens_per_expert": torch.full((4,), step * 64, dtype=torch.int64),
        }
        write_checkpoint(folder / f"step{step}", tensors)


def write_small_run(folder: Path, steps: list[int]) -> None:
    for step in steps:
        write_checkpoint(folder / f"step{step}", {"w": torch.full((16,), step / 1000).bfloat16()})


# -- running the blocks ----------------------------------------------------------------------------

_SIZE = re.compile(r"\b\d+(?:\.\d+)? ?(?:[kKMGT]i?B|B)(?!/s)\b")
_RATE = re.compile(r"\b\d+(?:\.\d+)? ?[kMGT]B/s\b")
_SECONDS = re.compile(r"\b\d+(?:\.\d+)? s\b")


def normalise(text: str) -> str:
    text = _RATE.sub("<rate>", text)
    text = _SIZE.sub("<size>", text)
    return _SECONDS.sub("<seconds>", text)


def matches(expected: str, actual: str) -> bool:
    """``actual`` fits ``expected``, whose ``...`` lines stand for any lines and ``...`` inside a
    line for any text (both normalised, trailing spaces ignored)."""
    pattern = []
    for line in normalise(expected).splitlines():
        line = line.rstrip()
        if line.strip() == "...":
            pattern.append(r"(?:[^\n]*\n)*?")
        else:
            pattern.append(".*".join(re.escape(part) for part in line.split("...")) + r"\n")
    actual_lines = "".join(line.rstrip() + "\n" for line in normalise(actual).splitlines())
    return re.fullmatch("".join(pattern), actual_lines) is not None


def _environment() -> dict[str, str]:
    """The commands of a page see this interpreter's ``ckptavg`` and ``torchrun`` first."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    env.pop("CKPTAVG_PROGRESS", None)
    return env


def _bash(script: str, cwd: Path, check: bool = True) -> subprocess.CompletedProcess:
    """``script`` in ``bash`` (with ``-e -o pipefail`` when ``check``: a failing command fails it)."""
    return subprocess.run(
        ["bash", *(["-eo", "pipefail"] if check else []), "-c", script],
        cwd=cwd,
        env=_environment(),
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _in_process(command: str) -> list[str] | None:
    """The arguments of a plain ``ckptavg ...`` command (no shell syntax beyond quotes and a
    comment), which runs in this process: a new interpreter per command costs ~2 s of imports."""
    try:
        words = shlex.split(command, comments=True)
    except ValueError:
        return None
    plain = words[:1] == ["ckptavg"] and not _SHELL.search(command.split("#", 1)[0])
    return words[1:] if plain else None


_SHELL = re.compile(r"[$`|&;<>(){}*?\[\]~]")


def _run(command: str, cwd: Path) -> tuple[int, str]:
    """A line of a block: its exit status and output (stdout then stderr)."""
    args = _in_process(command)
    done = _bash(command, cwd) if args is None else run_cli_in_process(*args)
    return done.returncode, done.stdout + done.stderr


def run_console(example: Example) -> str | None:
    """Every ``$ command`` of the block, each one's output against the block's. A block of plain
    ``ckptavg`` commands runs them in this process; any other runs in one shell, so that ``eval``
    and variables carry over from one command to the next."""
    commands: list[tuple[str, list[str]]] = []
    for line in example.parsed.splitlines():
        if line.startswith("$ "):
            commands.append((line[2:], []))
        elif commands:
            commands[-1][1].append(line)
    sandbox = example.namespace[SANDBOX]
    if all(_in_process(command) is not None for command, _ in commands):
        outputs = [_run(command, sandbox)[1] for command, _ in commands]
    else:
        marker = "ckptavg-doc-example-next-command"
        script = "exec 2>&1\n" + "".join(f"echo {marker}\n{command}\n" for command, _ in commands)
        outputs = _bash(script, sandbox, check=False).stdout.split(marker + "\n")[1:]
    for (command, expected), actual in zip(commands, outputs, strict=False):
        if not matches("\n".join(expected), actual):
            return f"$ {command}\n--- shown in the page:\n" + "\n".join(expected) + f"\n--- printed:\n{actual}"
    if len(outputs) != len(commands):
        return f"the shell stopped after {len(outputs)} of {len(commands)} commands:\n" + "".join(outputs)
    return None


def run_bash(example: Example) -> str | None:
    """The block's lines in order: plain ``ckptavg`` commands in this process, the rest (with the
    lines that continue them) in a shell; each must succeed."""
    for command in _logical_lines(example.parsed):
        status, output = _run(command, example.namespace[SANDBOX])
        if status != 0:
            return f"{command}\nexit status {status}:\n{output}"
    return None


def _logical_lines(script: str) -> list[str]:
    """Commands, one per line once backslash continuations are joined; blank lines and comments dropped."""
    lines: list[str] = []
    pending = ""
    for line in script.splitlines():
        pending += line
        if pending.endswith("\\"):
            pending = pending[:-1] + " "
            continue
        if pending.strip() and not pending.lstrip().startswith("#"):
            lines.append(pending)
        pending = ""
    return lines


# -- one Sybil a page: its sandbox and its runs ------------------------------------------------------


def _page(pattern: str, build: Callable[[Path], None]) -> Sybil:
    def setup(namespace: dict[str, Any]) -> None:
        sandbox = Path(tempfile.mkdtemp(prefix=f"ckptavg-docs-{Path(pattern).stem}-"))
        build(sandbox)
        namespace[SANDBOX] = sandbox
        namespace["_cwd"] = os.getcwd()
        os.chdir(sandbox)

    def teardown(namespace: dict[str, Any]) -> None:
        os.chdir(namespace["_cwd"])
        shutil.rmtree(namespace[SANDBOX], ignore_errors=True)

    return Sybil(
        parsers=[
            PythonCodeBlockParser(),
            CodeBlockParser("console", run_console),
            CodeBlockParser("bash", run_bash),
            SkipParser(),
            ClearNamespaceParser(),
        ],
        path=str(REPO),
        patterns=[pattern],
        setup=setup,
        teardown=teardown,
        fixtures=["s3_server"],  # the pages' s3:// examples reach it (AWS_ENDPOINT_URL)
    )


def _readme_runs(sandbox: Path) -> None:
    write_llama_run(sandbox / "runs" / "llama")
    write_small_run(sandbox / "runs" / "a", [10, 20])


def write_hooked_run(folder: Path) -> None:
    """A trainer checkpoint at step 4998, then the training hook's snapshots of steps 4999 and
    5000 (and its own merge of them at 5000), as a run with ``mode="snapshot"`` leaves them."""
    from ckptavg import MergeHook, MergeHookConfig

    model, optimizer, _, train_step, _ = toy_training()
    write_checkpoint(folder / "step4998", {k: v.detach().clone() for k, v in model.state_dict().items()})
    config = MergeHookConfig(str(folder), merge_steps=[5000], window=2, mode="snapshot")
    with MergeHook(config) as hook:
        hook.pre_train(4998)
        for step in (4999, 5000):
            train_step(model, optimizer)
            hook.post_train_batch(step, model)


def write_blocks_run(folder: Path) -> None:
    """The training hook's blocks of 10 steps, steps 1-40 (``mode="blocks"``), and nothing else."""
    from ckptavg import MergeHook, MergeHookConfig

    model, optimizer, _, train_step, _ = toy_training()
    with MergeHook(MergeHookConfig(str(folder), mode="blocks", block=10)) as hook:
        hook.pre_train(0)
        for step in range(1, 41):
            train_step(model, optimizer)
            hook.post_train_batch(step, model)


def _merge_page_runs(sandbox: Path) -> None:
    write_llama_run(sandbox / "runs" / "llama", [*range(910, 1001, 10), *LLAMA_STEPS])
    shutil.rmtree(sandbox / "runs" / "llama" / "step970")  # a gap, for the partial-window example
    write_hooked_run(sandbox / "runs" / "hooked")
    write_blocks_run(sandbox / "runs" / "blocks")
    write_small_run(sandbox / "runs" / "a", [10, 20])
    write_moe_run(sandbox / "runs" / "moe", [10, 20, 30])


PAGES = [
    _page("README.md", _readme_runs),
    _page("docs/plan.md", lambda sandbox: None),
    _page("docs/hook.md", lambda sandbox: None),
    _page("docs/merge.md", _merge_page_runs),
    _page("docs/weighting.md", _readme_runs),
]

pytest_collect_file = pytest_integration(*PAGES)


# -- what the pages' examples assume of the user's own code ----------------------------------------


class ToyModel(torch.nn.Module):
    """A user's model: ``model(batch).loss`` as Hugging Face models give it."""

    def __init__(self) -> None:
        super().__init__()
        self.linear = torch.nn.Linear(4, 4)

    def forward(self, batch: torch.Tensor) -> SimpleNamespace:
        return SimpleNamespace(loss=self.linear(batch).square().mean())


def toy_training() -> tuple[ToyModel, torch.optim.Optimizer, torch.Tensor, Callable[..., None], Callable[..., None]]:
    """A user's model, optimizer, batch, ``train_step(model, optimizer)`` and
    ``save_checkpoint(model, optimizer, **extra)`` (which keeps each one in
    ``saved_checkpoints``), as the hook examples use them; a step costs microseconds."""
    model = ToyModel()
    optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
    batch = torch.randn(8, 4, generator=torch.Generator().manual_seed(0))

    def train_step(model: ToyModel, optimizer: torch.optim.Optimizer) -> None:
        model(batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()

    def save_checkpoint(model: ToyModel, optimizer: torch.optim.Optimizer, **extra: Any) -> None:
        saved_checkpoints.append({"model": model.state_dict(), "optimizer": optimizer.state_dict(), **extra})

    return model, optimizer, batch, train_step, save_checkpoint


saved_checkpoints: list[dict[str, Any]] = []


def upload_olmo_core_run(url: str, steps: range) -> None:
    """OLMo-core checkpoints (saved by OLMo-core's own Checkpointer) at ``url`` on the test S3
    server, its bucket made if need be."""
    from checkpoint_builders import write_olmo_core_checkpoint
    from helpers import other_writer, upload

    fs, root = other_writer(url)
    bucket = root.split("/", 1)[0]
    if not fs.exists(bucket):
        fs.mkdir(bucket)
    with tempfile.TemporaryDirectory() as local:
        for step in steps:
            write_olmo_core_checkpoint(local, step)
        upload(Path(local), url)

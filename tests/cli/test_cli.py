"""The command line through its real entry points: output formats, exit codes, one-line errors."""

from __future__ import annotations

import io
import json
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest
from helpers import make_run, poison_tensor_data, run_cli, run_cli_in_process, stat_tree, tree_of
from references import load_merged

from ckptavg.merging.progress import ByteProgress


def _one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> None:
    assert proc.returncode == 1, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("ckptavg: error: ")
    assert "Traceback" not in proc.stderr
    for fragment in fragments:
        assert fragment in lines[0]


def test_console_script_is_installed():
    script = shutil.which("ckptavg") or str(Path(sys.executable).parent / "ckptavg")
    proc = subprocess.run([script, "--version"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0
    assert proc.stdout.startswith("ckptavg ")


def test_plan_text_shows_table_fixed_steps_and_timeline():
    proc = run_cli(
        "plan", "--periods", "100B,100B", "--tokens-per-step", "4M", "--decay-fraction", "0.1", "--window", "100"
    )
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "22500" in out and "22401-22500" in out and "90B" in out
    assert "47401-47500" in out
    assert "checkpoints to keep" in out and "(fixed steps): 22401 47401" in out
    assert "schedule" in out and "\\" in out and "^" in out


def test_plan_json_and_env_agree():
    args = [
        "plan",
        "--periods",
        "1T",
        "--periods",
        "500B",
        "--batch-size",
        "1024",
        "--seq-len",
        "4096",
        "--decay",
        "50B",
        "--window",
        "200",
    ]
    data = json.loads(run_cli(*args, "--format", "json").stdout)
    env = run_cli(*args, "--format", "env").stdout
    expected = [(10**12 - 5 * 10**10) // (1024 * 4096), (15 * 10**11 - 5 * 10**10) // (1024 * 4096)]
    assert data["merge_steps"] == expected
    assert data["tokens_per_step"] == 1024 * 4096
    sourced = subprocess.run(
        ["bash", "-c", f'{env}\necho "$CKPTAVG_MERGE_STEPS|$CKPTAVG_FIXED_STEPS|$CKPTAVG_WINDOW"'],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    merge_steps, fixed, window = sourced.split("|")
    assert [int(s) for s in merge_steps.split()] == expected
    assert [int(s) for s in fixed.split()] == data["fixed_steps"]
    assert window == "200"


def test_plan_interval():
    data = json.loads(
        run_cli("plan", "--interval", "1000", "--max-steps", "3500", "--window", "10", "--format", "json").stdout
    )
    assert data["merge_steps"] == [1000, 2000, 3000]
    assert data["fixed_steps"] == [991, 1991, 2991]


def test_plan_window_in_tokens_and_a_warning_line_per_window_in_the_warmup_or_a_decay():
    """``--window 2B`` at 4M tokens per step is 500 steps; ``--warmup 2.4B`` ends at step 600; the
    decay is the run's last 20 %. Each window that reaches into either is one warning line on
    stderr, and the plan is printed all the same (exit 0), in every format."""
    args = ["plan", "--interval", "1000", "--max-steps", "10000", "--tokens-per-step", "4M", "--window", "2B"]
    args += ["--decay-fraction", "0.2", "--warmup", "2.4B"]
    warnings = [
        "ckptavg: warning: merge at step 1000: its window 501-1000 starts inside the warmup, which ends at step 600",
        "ckptavg: warning: merge at step 9000: its window 8501-9000 reaches into the decay phase (steps 8001-10000)",
        "ckptavg: warning: merge at step 10000: its window 9501-10000 reaches into the decay phase (steps 8001-10000)",
    ]
    text = run_cli_in_process(*args)
    assert text.returncode == 0 and text.stderr.splitlines() == warnings
    assert "window: 2B tokens = 500 steps of 4000000 tokens\n" in text.stdout and "9501-10000" in text.stdout
    assert "schedule ////" in text.stdout and "/ warmup  = stable  \\ decay  # window" in text.stdout
    data = json.loads(run_cli_in_process(*args, "--format", "json").stdout)
    assert (data["window"], data["window_tokens"], data["warmup_steps"]) == (500, 2 * 10**9, 600)
    assert data["warnings"] == [line.removeprefix("ckptavg: warning: ") for line in warnings]
    assert data["periods"] == [{"period": 1, "start_step": 0, "decay_start_step": 8000, "end_step": 10000}]
    env = run_cli_in_process(*args, "--format", "env")
    assert env.stderr.splitlines() == warnings and "CKPTAVG_WINDOW=500\n" in env.stdout

    many = run_cli_in_process(
        "plan", "--interval", "10", "--max-steps", "1000", "--window", "10", "--decay-fraction", "0.5"
    )
    lines = many.stderr.splitlines()
    assert many.returncode == 0 and len(lines) == 11
    assert lines[-1] == "ckptavg: warning: and 40 more windows that reach into the warmup or a decay phase"


@pytest.mark.parametrize(
    ("args", "fragment"),
    [
        (
            ["--periods", "1000", "--tokens-per-step", "10", "--decay", "100", "--window", "100"],
            "smaller than the window",
        ),
        (
            ["--interval", "10", "--max-steps", "100", "--window", "80B"],
            "--window 80B is in tokens: give --tokens-per-step",
        ),
        (
            ["--periods", "100B", "--tokens-per-step", "4M", "--decay", "0", "--window", "1M"],
            "--window 1M is less than",
        ),
        (["--interval", "10", "--max-steps", "100", "--window", "5", "--decay", "1B"], "--decay is in tokens"),
        (["--interval", "10", "--max-steps", "100", "--window", "5", "--warmup", "2B"], "--warmup 2B is in tokens"),
        (
            ["--periods", "1000", "--tokens-per-step", "10", "--decay", "2000", "--window", "5"],
            "longer than the period",
        ),
        (["--interval", "500", "--max-steps", "100", "--window", "5"], "nothing to merge"),
        (["--periods", "12Q", "--tokens-per-step", "1", "--window", "5"], "unknown suffix 'Q'"),
        (["--periods", "100B", "--window", "5"], "needs --tokens-per-step"),
    ],
)
def test_plan_errors_are_one_line(args, fragment):
    _one_line_error(run_cli("plan", *args), fragment)


def test_merge_dry_run_json_and_ls(tmp_path):
    run = tmp_path / "run"
    saved = make_run(run, [100, 200, 300], {"w": (1000,), "v": (10, 10)}, shards=2)
    dry = run_cli("merge", str(run), "--merge-step", "300", "--window", "200", "--dry-run")
    assert dry.returncode == 0, dry.stderr
    assert "would average 2 checkpoints" in dry.stdout and "step300-merged" in dry.stdout
    assert "4.40 kB to read" in dry.stdout  # 2 x (1000 + 100) x 2 bytes
    assert not (run / "step300-merged").exists()

    proc = run_cli("merge", str(run), "--merge-step", "300", "--window", "200", "--json")
    assert proc.returncode == 0, proc.stderr
    result = json.loads(proc.stdout)
    assert [s["step"] for s in result["sources"]] == [200, 300]
    assert result["bytes_read"] == 4400
    merged = load_merged(run / "step300-merged")
    assert merged["w"].dtype == saved[300]["w"].dtype

    listing = run_cli("ls", str(run))
    assert listing.returncode == 0
    lines = listing.stdout.splitlines()
    assert lines[0].split() == ["step", "name", "format", "size", "status"]
    assert any(
        line.split()[:3] == ["300", "step300-merged", "safetensors"] and line.endswith("merged") for line in lines
    )
    rows = json.loads(run_cli("ls", str(run), "--json").stdout)
    assert [(r["step"], r["status"]) for r in rows] == [
        (100, "complete"),
        (200, "complete"),
        (300, "complete"),
        (300, "merged"),
    ]


def test_merge_summary_line_and_quiet(tmp_path):
    run = tmp_path / "run"
    make_run(run, [1, 2], {"w": (100,)})
    proc = run_cli("merge", str(run), "--last", "2", "--dtype", "fp32")
    assert proc.returncode == 0, proc.stderr
    assert "ckptavg: merged 2 checkpoints (steps 1, 2, 1 tensors)" in proc.stderr and "GB/s" in proc.stderr
    assert "\r" not in proc.stderr  # not a TTY: no progress bar
    assert load_merged(run / "step2-merged")["w"].dtype.itemsize == 4
    quiet = run_cli("merge", str(run), "--last", "2", "--force", "--quiet")
    assert quiet.returncode == 0 and quiet.stderr == "" and quiet.stdout == ""


def test_threads_and_mmap_options_change_no_byte_of_the_output(tmp_path):
    run = tmp_path / "run"
    make_run(run, [1, 2, 3], {"w": (300, 70), "b": (70,)}, shards=2)
    outputs = {}
    for name, extra in {"default": [], "threads3": ["--threads", "3"], "mmap": ["--mmap", "--threads", "1"]}.items():
        result = run_cli_in_process("merge", str(run), "--last", "3", "--out", str(tmp_path / name), *extra)
        assert result.returncode == 0, result.stderr
        outputs[name] = {k: v for k, v in tree_of(tmp_path / name).items() if k != "ckptavg-manifest.json"}
    assert outputs["threads3"] == outputs["default"] == outputs["mmap"]
    refused = run_cli_in_process("merge", str(run), "--last", "3", "--out", str(tmp_path / "zero"), "--threads", "0")
    assert refused.returncode == 1 and refused.stderr.count("\n") == 1 and "--threads" in refused.stderr


def test_merge_errors_are_one_line(tmp_path):
    run = tmp_path / "run"
    make_run(run, [100, 200], {"w": (10,)})
    _one_line_error(run_cli("merge", str(run), "--merge-step", "50", "--window", "10"), "steps found: 100, 200")
    _one_line_error(run_cli("merge", str(tmp_path / "nope"), "--last", "1"), "does not exist")
    _one_line_error(run_cli("merge", str(run), "--last", "2", "--dtype", "int8"), "unknown --dtype")
    run_cli("merge", str(run), "--last", "2")
    _one_line_error(run_cli("merge", str(run), "--last", "2", "--dtype", "fp32"), "already exists; pass --force")


@pytest.mark.parametrize("resume", [False, True], ids=["rerun", "rerun-with-resume"])
def test_rerunning_a_finished_merge_reads_nothing_writes_nothing_and_exits_0(tmp_path, resume):
    """A requeued job reruns a merge that had finished: one note, exit 0, no tensor read (the
    sources' tensor data is NaN now: a read would fail), no byte or time stamp changed;
    --dry-run says the same. Another merge into that folder is still refused, --force recomputes."""
    run = tmp_path / "run"
    make_run(run, [1, 2, 3], {"w": (300, 70), "b": (70,)}, shards=2)
    args = ["merge", str(run), "--last", "2", "--shard-size", "30KB", "--dtype", "fp32", "--ema-halflife", "2"]
    out = run / "step3-merged"
    assert run_cli_in_process(*args).returncode == 0
    merged = tree_of(out)
    forced = run_cli_in_process(*args, "--force", "--json")
    assert forced.returncode == 0 and json.loads(forced.stdout)["bytes_read"] > 0, forced.stderr
    assert tree_of(out) == merged  # recomputed, to the same bytes

    poison_tensor_data(run / "step2", run / "step3")
    before = stat_tree(tmp_path)
    note = f"ckptavg: note: {out}: already merged, manifest matches; nothing to do\n"
    again = run_cli_in_process(*args, *(["--resume"] if resume else []))
    assert (again.returncode, again.stderr, again.stdout) == (0, note, "")
    as_json = run_cli_in_process(*args, "--json", *(["--resume"] if resume else []))
    assert as_json.returncode == 0 and as_json.stderr == note, as_json.stderr
    payload = json.loads(as_json.stdout)
    assert payload["already_merged"] and payload["bytes_read"] == 0
    assert set(payload["files"]) == set(merged) - {"ckptavg-manifest.json"}
    dry = run_cli_in_process(*args, "--dry-run", "--json")
    assert dry.returncode == 0 and dry.stderr == note and json.loads(dry.stdout)["already_merged"], dry.stderr
    assert stat_tree(tmp_path) == before
    # Not the same merge: another dtype, another weighting, another window, another shard size.
    for other in (["--dtype", "bf16"], ["--ema-halflife", "3"], ["--last", "3"], ["--shard-size", "1GB"]):
        changed = [*args, *other]
        _one_line_error(run_cli_in_process(*changed), f"output {out} already exists; pass --force")
        dry = run_cli_in_process(*changed, "--dry-run", "--json")
        refusal = f"ckptavg: note: {out} already exists, and is not this merge: the run would refuse it"
        assert dry.stderr == f"{refusal} (--force replaces it)\n" and not json.loads(dry.stdout)["already_merged"], (
            other
        )
    assert stat_tree(tmp_path) == before


def test_help_teaches_with_examples():
    proc = run_cli("merge", "--help")
    assert proc.returncode == 0
    for option in ("--merge-step", "--window", "--last", "--steps", "--dry-run", "--dtype", "--shard-size", "--force"):
        assert option in proc.stdout
    assert "ckptavg merge runs/llama --merge-step 5000 --window 100" in proc.stdout


def test_log_progress_without_tty_is_plain_lines():
    stream = io.StringIO()
    progress = ByteProgress(3000, stream=stream, interval=0.0)
    for _ in range(3):
        progress(1000)
    progress.close()
    lines = stream.getvalue().splitlines()
    assert len(lines) == 3 and "\r" not in stream.getvalue()
    assert lines[-1].startswith("ckptavg: merge: 3.00 kB of 3.00 kB (100%)")


# -- usage errors: one line and exit 1, like every user error ---------------------------------


@pytest.mark.parametrize(
    ("args", "fragments"),
    [
        (["merge", "RUN", "--merge-step", "abc", "--window", "5"], ("'--merge-step'", "'abc'", "ckptavg merge --help")),
        (["merge", "RUN", "--last", "2", "--workers", "0"], ("'--workers'", "'0'")),
        (["merge", "RUN", "--last", "2", "--workers=-3"], ("'--workers'", "'-3'")),
        (["merge", "RUN", "--last", "2", "--format", "npz"], ("'--format'", "'npz'")),
        (["merge", "RUN", "--last", "2", "--weighting", "sma"], ("'--weighting'", "'sma'")),
        (["merge", "RUN", "--bogus"], ("--bogus",)),
        (["merge"], ("Missing argument", "'RUN_DIR'")),
        (["plan", "--window", "1e3", "--interval", "10", "--max-steps", "100"], ("'--window'", "'1e3'")),
        (["verify", "OUT", "--sample", "0"], ("'--sample'", "'0'", "ckptavg verify --help")),
        (["ls"], ("Missing argument",)),
        (["frobnicate"], ("frobnicate", "ckptavg --help")),
        (["--bogus"], ("--bogus",)),
    ],
    ids=lambda value: " ".join(value) if isinstance(value, list) else None,
)
def test_usage_errors_are_one_line_with_exit_status_1(tmp_path, args, fragments):
    """Click's usage block and exit status 2 would be the only multi-line error of the CLI."""
    args = [str(tmp_path) if a in ("RUN", "OUT") else a for a in args]
    _one_line_error(run_cli_in_process(*args), *fragments)


def test_usage_errors_are_the_same_line_through_the_real_entry_point(tmp_path):
    args = ["merge", str(tmp_path), "--last", "2", "--workers", "0"]
    real, in_process = run_cli(*args), run_cli_in_process(*args)
    _one_line_error(real, "'--workers'", "'0'")
    assert (real.returncode, real.stderr, real.stdout) == (in_process.returncode, in_process.stderr, "")


@pytest.mark.parametrize("command", ["merge", "plan", "verify", "ls"])
def test_help_names_values_as_the_docs_do(command):
    """``Usage: ckptavg merge [OPTIONS] RUN_DIR`` and ``--window WINDOW``: no Python type
    (``<list[str]>``, ``<int range>``, ``<str>``) and no ``{run_dir}``; choices stay listed."""
    help_text = run_cli_in_process(command, "--help").stdout
    usage = help_text.splitlines()[0]
    assert usage.startswith(f"Usage: ckptavg {command} [OPTIONS]") and "{" not in usage, usage
    for python_type in ("<str>", "<int", "<float>", "list[", "range>", "{run_dir}"):
        assert python_type not in help_text, (python_type, help_text)
    if command == "merge":
        assert "--window WINDOW" in help_text and "<safetensors|dcp|pt>" in help_text


def test_a_refused_choice_reads_without_pydantics_prefix():
    result = run_cli_in_process("merge", "RUN", "--last", "2", "--format", "xyz")
    _one_line_error(result, "'xyz' is not one of 'safetensors', 'dcp', 'pt'")
    assert "Value error" not in result.stderr


@pytest.mark.parametrize("args", [["--help"], ["merge", "--help"], ["plan", "--help"], ["--version"], []])
def test_help_and_version_still_exit_0(args):
    """A bare ``ckptavg`` asks what there is to do: the help answers it, not an error."""
    result = run_cli_in_process(*args)
    assert result.returncode == 0 and result.stderr == "" and result.stdout


# -- command-line extremes: one line, fast, in bounded memory ---------------------------------

MERGE = ["merge", "RUN", "--last", "2"]
PLAN = ["plan", "--tokens-per-step", "1", "--decay", "0", "--window", "5"]
INTERVAL = ["plan", "--interval", "10"]
STEP = 10**15  # a window this long must be counted, not listed


@dataclass(frozen=True)
class Extreme:
    id: str
    args: list[str]
    names: tuple[str, ...]  # what the error line must name
    capped: bool = False  # memory is the point: run the real entry point under an address-space cap


EXTREMES = [
    Extreme("chunk-size-1TB", [*MERGE, "--chunk-size", "1TB"], ("chunk size 1000000000000 bytes", "at most"), True),
    Extreme("chunk-size-1e30", [*MERGE, "--chunk-size", "1e30"], ("--chunk-size '1e30'", "too large")),
    Extreme("chunk-size-dry-run", [*MERGE, "--chunk-size", "2GiB", "--dry-run"], ("chunk size 2147483648 bytes",)),
    Extreme("shard-size-1e400", [*MERGE, "--shard-size", "1e400"], ("--shard-size '1e400'", "too large")),
    Extreme("weights-inf", [*MERGE, "--weights", "1e400,1"], ("--weights", "finite", "inf")),
    Extreme("weights-nan", [*MERGE, "--weights", "nan,1"], ("--weights", "finite", "nan")),
    Extreme("ema-halflife-subnormal", [*MERGE, "--ema-halflife", "1e-320"], ("--ema-halflife", "1e-320", "1e-300")),
    Extreme("ema-alpha-nan", [*MERGE, "--ema-alpha", "nan"], ("--ema-alpha", "nan")),
    Extreme("merge-last-0", [*MERGE[:2], "--last", "0"], ("'--last'", "'0'")),
    Extreme("merge-every-0", [*MERGE[:2], "--merge-step", "200", "--window", "5", "--every", "0"], ("'--every'",)),
    Extreme(
        "merge-window-of-1e15-steps",
        [*MERGE[:2], "--merge-step", str(STEP), "--window", str(STEP), "--every", "1"],
        (f"window 1-{STEP} misses {STEP - 2} steps: 1, 2, 3, 4, 5, 6, 7, 8, 9, 10 ...",),
        True,
    ),
    Extreme(
        "merge-window-past-int64",
        [*MERGE[:2], "--merge-step", "200", "--window", str(10**30)],
        ("window 0-200 misses 1 step: 0",),
        True,
    ),
    Extreme("periods-1e400", [*PLAN, "--periods", "1e400"], ("--periods '1e400' is too large", str(2**63 - 1))),
    Extreme("periods-1e5000", [*PLAN, "--periods", "1e5000"], ("--periods '1e5000' is too large",), True),
    Extreme("periods-nan", [*PLAN, "--periods", "nan"], ("--periods 'nan'",)),
    Extreme("decay-1e-999999999", [*PLAN, "--periods", "100", "--decay", "1e-999999999"], ("not a whole number",)),
    Extreme(
        "tokens-per-step-exponent-past-int64",
        ["plan", "--periods", "100", "--tokens-per-step", "1e99999999999999999999", "--decay", "0", "--window", "5"],
        ("--tokens-per-step", "too large"),
    ),
    Extreme(
        "a-merge-every-step-of-2e7",
        ["plan", "--interval", "1", "--max-steps", "20000000", "--window", "1"],
        ("20000000 merges", "100000"),
        True,
    ),
    Extreme(
        "negative-batch-size-and-seq-len",
        ["plan", "--periods", "100", "--batch-size", "-4", "--seq-len", "-5", "--decay", "0", "--window", "5"],
        ("'--batch-size'", "'-4'"),
    ),
    Extreme("plan-window-0", [*INTERVAL, "--max-steps", "100", "--window", "0"], ("'--window'", "'0'")),
    Extreme(
        "plan-window-1e400-tokens",
        [*INTERVAL, "--max-steps", "100", "--tokens-per-step", "1", "--window", "1e400B"],
        ("'--window'", "'1e400B' is too large"),
    ),
    Extreme(
        "plan-warmup-1e5000-tokens",
        [*INTERVAL, "--max-steps", "100", "--window", "5", "--warmup", "1e5000T"],
        ("'--warmup'", "too large"),
        True,
    ),
    Extreme("plan-interval-negative", ["plan", "--interval", "-10", "--max-steps", "100", "--window", "1"], ("'-10'",)),
    Extreme("plan-max-steps-0", [*INTERVAL, "--max-steps", "0", "--window", "1"], ("'--max-steps'", "'0'")),
    Extreme("tokens-per-step-0", [*PLAN[:1], "--periods", "100", "--tokens-per-step", "0", *PLAN[3:]], ("got 0",)),
]


@pytest.mark.parametrize("case", EXTREMES, ids=[case.id for case in EXTREMES])
def test_command_line_extremes_are_one_line_fast_and_small(tmp_path, case):
    """Every class of extreme option value: exit status 1, one error line naming the option or
    the value, nothing written, in seconds; the cases about memory run under a 2 GiB address
    space (torch alone maps about 0.7 GiB), where a list of every step would fail."""
    run = tmp_path / "run"
    make_run(run, [100, 200], {"w": (8,)})
    args = [str(run) if a == "RUN" else a for a in case.args]
    before = tree_of(tmp_path)
    started = time.monotonic()
    result = run_cli(*args, address_space=2 * 2**30, timeout=60) if case.capped else run_cli_in_process(*args)
    assert time.monotonic() - started < 30
    _one_line_error(result, *case.names)
    assert tree_of(tmp_path) == before


def test_chunk_size_is_bounded_by_available_memory(tmp_path, monkeypatch):
    """9 chunk buffers must fit in the memory the OS says is available."""
    import ckptavg.merging.engine

    run = tmp_path / "run"
    make_run(run, [1, 2], {"w": (8,)})
    monkeypatch.setattr(ckptavg.merging.engine, "available_memory", lambda: 90 * 2**20)
    _one_line_error(
        run_cli_in_process("merge", str(run), "--last", "2", "--chunk-size", "16MiB"),
        "chunk size 16777216 bytes is too large: at most 10485760",
        "a merge holds 9 chunks at once and 94.37 MB of memory is available",
    )
    assert run_cli_in_process("merge", str(run), "--last", "2", "--chunk-size", "8MiB").returncode == 0
    monkeypatch.undo()
    memory = ckptavg.merging.engine.available_memory()
    assert memory is not None and memory > 0  # Linux says


@pytest.mark.parametrize(
    ("proc_cgroup", "files", "left"),
    [
        ("0::/job\n", {"job/memory.max": "1000000", "job/memory.current": "250000"}, 750000),
        ("0::/job\n", {"job/memory.max": "max", "job/memory.current": "250000"}, None),
        (
            "4:memory:/slurm/job7\n0::/\n",
            {"memory/slurm/job7/memory.limit_in_bytes": "4096000", "memory/slurm/job7/memory.usage_in_bytes": "96000"},
            4000000,
        ),
        (
            "4:memory:/\n",
            {"memory/memory.limit_in_bytes": "9223372036854771712", "memory/memory.usage_in_bytes": "96000"},
            None,
        ),
    ],
    ids=["v2-limit", "v2-no-limit", "v1-limit", "v1-no-limit"],
)
def test_a_cgroup_memory_limit_bounds_the_available_memory(tmp_path, monkeypatch, proc_cgroup, files, left):
    """In a SLURM job or a container MemAvailable describes the whole host; the cgroup's limit
    is what the merge may really use."""
    import ckptavg.merging.engine

    (tmp_path / "cgroup").write_text(proc_cgroup)
    for name, content in files.items():
        (tmp_path / "root" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "root" / name).write_text(content)
    monkeypatch.setattr(ckptavg.merging.engine, "_PROC_CGROUP", str(tmp_path / "cgroup"))
    monkeypatch.setattr(ckptavg.merging.engine, "_CGROUP_ROOT", str(tmp_path / "root"))
    assert ckptavg.merging.engine._cgroup_memory_left() == left
    if left is not None:
        assert ckptavg.merging.engine.available_memory() <= left


def test_key_patterns_that_match_nothing_get_a_note(tmp_path):
    """A glob or prefix that changes nothing is most likely a typo: one note each, and the merge
    goes on (what matched is merged); patterns that match say nothing."""
    make_run(tmp_path / "run", [1, 2], {"model.a": (8,), "model.b": (8,)})
    newest = tmp_path / "run" / "step2"
    args = ["merge", str(tmp_path / "run"), "--last", "2", "--include", "model.*,optim.*", "--exclude", "model.c"]
    result = run_cli_in_process(*args, "--strip-prefix", "decoder.")
    assert result.returncode == 0, result.stderr
    notes = [line for line in result.stderr.splitlines() if line.startswith("ckptavg: note: ")]
    assert notes == [
        f"ckptavg: note: {newest}: --include 'optim.*' matches no tensor",
        f"ckptavg: note: {newest}: --exclude 'model.c' matches no tensor",
        f"ckptavg: note: {newest}: --strip-prefix 'decoder.' begins no averaged tensor's name",
    ]
    quiet = run_cli_in_process(
        *args[:-4], "--exclude", "model.b", "--strip-prefix", "model.", "--out", str(tmp_path / "b")
    )
    assert quiet.returncode == 0 and "note" not in quiet.stderr, quiet.stderr


def test_paths_show_as_typed_in_the_dry_run_the_run_and_errors(tmp_path, monkeypatch):
    """A relative run folder and --out are shown as typed, not as absolute paths, and the same
    in the dry run as in the run; so is a path inside them in an error."""
    make_run(tmp_path / "run", [1, 2], {"w": (8,)})
    monkeypatch.chdir(tmp_path)
    dry = run_cli_in_process("merge", "run", "--last", "2", "--out", "merged/", "--dry-run")
    real = run_cli_in_process("merge", "run", "--last", "2", "--out", "merged/")
    assert dry.returncode == real.returncode == 0, dry.stderr + real.stderr
    assert "into merged/:" in dry.stdout and "  run/step1" in dry.stdout and str(tmp_path) not in dry.stdout
    assert "into merged/:" in real.stderr and str(tmp_path) not in real.stderr
    (tmp_path / "run" / "step2" / "model.safetensors").write_bytes(b"\0" * 8)
    broken = run_cli_in_process("merge", "run", "--last", "2", "--out", "again/")
    assert broken.returncode == 1 and broken.stderr.startswith("ckptavg: error: run/step2/model.safetensors")


def test_a_dry_run_says_what_the_run_would_do_with_an_existing_output(tmp_path):
    make_run(tmp_path / "run", [1, 2, 3], {"w": (8,)})
    run, out = str(tmp_path / "run"), str(tmp_path / "run" / "step3-merged")
    assert run_cli_in_process("merge", run, "--last", "2").returncode == 0
    other = run_cli_in_process("merge", run, "--last", "3", "--dry-run")
    assert f"ckptavg: note: {out} already exists, and is not this merge: the run would refuse it" in other.stderr
    forced = run_cli_in_process("merge", run, "--last", "3", "--dry-run", "--force")
    assert (
        f"ckptavg: note: {out} already exists: the run would replace it once the new one is complete" in forced.stderr
    )
    same = run_cli_in_process("merge", run, "--last", "2", "--dry-run")
    assert f"ckptavg: note: {out}: already merged, manifest matches; nothing to do" in same.stderr

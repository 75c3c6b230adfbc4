"""Runs and outputs on fsspec filesystems: ``memory://`` and an S3 server on loopback (moto).

Object stores have no rename, so a merge writes its files in place and the manifest last; these
tests check that nothing unfinished ever looks finished, that inputs are read by byte ranges
only, that listings are never stale, and that credentials never reach a message.
"""

from __future__ import annotations

import hashlib
import json
import re
import socket
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch
from helpers import make_run, other_writer, run_cli_in_process, upload
from references import correctly_rounded, load_merged, same_bits
from safetensors.torch import load
from typer.testing import CliRunner

import ckptavg
from ckptavg import CkptavgError, MergeOptions, OutputError
from ckptavg.cli import app
from ckptavg.io.fs import display, redact, resolve

SHAPES = {"model.embed.weight": (64, 16), "model.layers.0.w": (16, 16), "lm_head.weight": (64, 16)}
MANIFEST = "ckptavg-manifest.json"
INDEX = "model.safetensors.index.json"


@pytest.fixture(params=["memory", "s3"])
def remote(request: pytest.FixtureRequest) -> Iterator[str]:
    """A fresh, empty folder URL on ``memory://`` or on the S3 server (started only when used)."""
    if request.param == "s3":
        yield request.getfixturevalue("s3_prefix")
        return
    url = f"memory://ckptavg-test/{uuid.uuid4().hex[:12]}"
    yield url
    fs, path = other_writer(url)
    if fs.exists(path):
        fs.rm(path, recursive=True)


def remote_run(tmp_path: Path, url: str, steps=(10, 20, 30), shards: int = 2):
    """A run of drifting bf16 checkpoints written locally, uploaded to ``url``; the tensors."""
    saved = make_run(tmp_path / "local-run", list(steps), SHAPES, shards=shards)
    upload(tmp_path / "local-run", url)
    return saved


def read_remote(url: str) -> tuple[dict[str, torch.Tensor], dict[str, bytes]]:
    """The merged tensors (through the index) and every file of a remote output folder."""
    fs, root = other_writer(url)
    files = {p[len(root) + 1 :]: fs.cat_file(p) for p in fs.find(root)}
    index = json.loads(files[INDEX])
    tensors: dict[str, torch.Tensor] = {}
    for name in sorted(set(index["weight_map"].values())):
        tensors.update(load(files[name]))
    assert set(tensors) == set(index["weight_map"])
    return tensors, files


def assert_mean(merged: dict[str, torch.Tensor], saved: dict, steps) -> None:
    """Bit for bit the float64 mean of ``steps``, rounded once to bf16."""
    assert set(merged) == set(SHAPES)
    for name, tensor in merged.items():
        mean = sum(saved[s][name].double() for s in steps) / len(steps)
        assert tensor.dtype == torch.bfloat16
        assert bool(same_bits(tensor, correctly_rounded(mean, torch.bfloat16)).all()), name


def assert_manifest(files: dict[str, bytes], source_prefix: str) -> dict:
    """The manifest names every other file with its sha256, and the sources by URL."""
    manifest = json.loads(files[MANIFEST])
    assert set(manifest["files"]) == set(files) - {MANIFEST}
    for name, entry in manifest["files"].items():
        assert hashlib.sha256(files[name]).hexdigest() == entry["sha256"], name
    assert all(s["path"].startswith(source_prefix) for s in manifest["sources"])
    return manifest


def cli(*args: str):
    return CliRunner().invoke(app, list(args))


def statuses(run_url: str) -> dict[str, str]:
    result = cli("ls", run_url, "--json")
    assert result.exit_code == 0, result.output
    return {row["name"]: row["status"] for row in json.loads(result.stdout)}


def test_merge_remote_run_into_remote_output(tmp_path, remote):
    saved = remote_run(tmp_path, f"{remote}/run")
    result = ckptavg.merge(f"{remote}/run", merge_step=30, window=20, options=MergeOptions(shard_size=3000))
    out = f"{remote}/run/step30-merged"
    assert result.output == display(*resolve(out))
    merged, files = read_remote(out)
    assert_mean(merged, saved, [20, 30])
    manifest = assert_manifest(files, remote.split("://")[0] + "://")
    assert [s["step"] for s in manifest["sources"]] == [20, 30]
    assert len([f for f in files if f.endswith(".safetensors")]) >= 2
    assert "config.json" in files
    assert statuses(f"{remote}/run")["step30-merged"] == "merged"
    # No hidden temporary folder beside the output: object stores are written in place.
    fs, root = other_writer(f"{remote}/run")
    assert sorted(p.rsplit("/", 1)[-1] for p in fs.ls(root, detail=False)) == [
        "step10",
        "step20",
        "step30",
        "step30-merged",
    ]


def test_local_output_from_remote_input(tmp_path, remote):
    saved = remote_run(tmp_path, f"{remote}/run", shards=1)
    out = tmp_path / "avg"
    ckptavg.merge(f"{remote}/run", last=3, out=str(out))
    assert_mean(load_merged(out), saved, [10, 20, 30])
    manifest = json.loads((out / MANIFEST).read_text())
    assert set(manifest["files"]) == {p.name for p in out.iterdir()} - {MANIFEST}
    assert (out / "config.json").read_bytes() == (tmp_path / "local-run" / "step30" / "config.json").read_bytes()
    assert [s["path"] for s in manifest["sources"]] == [
        display(*resolve(f"{remote}/run/step{s}")) for s in (10, 20, 30)
    ]


def test_remote_output_from_local_input(tmp_path, remote, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a remote path written to the local disk would land here
    saved = make_run(tmp_path / "run", [1, 2], SHAPES)
    ckptavg.merge(str(tmp_path / "run"), last=2, out=f"{remote}/avg")
    merged, files = read_remote(f"{remote}/avg")
    assert_mean(merged, saved, [1, 2])
    assert_manifest(files, str(tmp_path / "run"))
    assert files["config.json"] == (tmp_path / "run" / "step2" / "config.json").read_bytes()


def test_existing_remote_output_needs_force(tmp_path, remote):
    remote_run(tmp_path, f"{remote}/run", steps=(1, 2), shards=1)
    ckptavg.merge(f"{remote}/run", last=2, options=MergeOptions(shard_size=3000))
    out = f"{remote}/run/step2-merged"
    first = read_remote(out)[1]
    with pytest.raises(CkptavgError, match="already exists; pass --force"):
        ckptavg.merge(f"{remote}/run", last=1)
    fs, root = other_writer(f"{remote}/run")
    fs.pipe_file(f"{root}/step2-merged.bak/keep.txt", b"not ours")  # a name the target's prefix starts
    # --force replaces every file: the old shards (3000-byte shards) do not survive.
    ckptavg.merge(f"{remote}/run", last=1, options=MergeOptions(force=True))
    merged, files = read_remote(out)
    assert set(files) != set(first)
    assert fs.cat_file(f"{root}/step2-merged.bak/keep.txt") == b"not ours"
    assert json.loads(files[MANIFEST])["sources"][0]["step"] == 2
    assert_manifest(files, remote.split("://")[0] + "://")


@pytest.mark.parametrize(
    ("out", "said"),
    [
        ("run", "is the run folder"),
        ("run/./step2", "is the source checkpoint"),
        ("run//step2/", "is the source checkpoint"),
        ("run/step1/../step2", "is the source checkpoint"),
        ("run/step2/avg", "lies inside the source checkpoint"),
        (".", "contains the run folder"),
    ],
)
def test_an_output_over_a_remote_source_or_run_is_refused(tmp_path, remote, out, said):
    """Object stores compare fsspec-normalised URLs: ``./``, ``//``, ``..`` and a trailing ``/``
    cannot make a source (or the folder above it) look like another place; ``force`` or not."""
    remote_run(tmp_path, f"{remote}/run", steps=(1, 2), shards=1)
    fs, root = other_writer(remote)
    before = {p: fs.cat_file(p) for p in fs.find(root)}
    with pytest.raises(CkptavgError, match=said):
        ckptavg.merge(f"{remote}/run", last=2, out=f"{remote}/{out}", options=MergeOptions(force=True))
    assert {p: fs.cat_file(p) for p in fs.find(root)} == before


def test_folder_without_manifest_is_an_unfinished_merge(tmp_path, remote):
    saved = remote_run(tmp_path, f"{remote}/run", steps=(1, 2), shards=1)
    ckptavg.merge(f"{remote}/run", last=2)
    fs, root = other_writer(f"{remote}/run")
    fs.rm_file(f"{root}/step2-merged/{MANIFEST}")  # as a merge killed before its last file
    assert statuses(f"{remote}/run") == {
        "step1": "complete",
        "step2": "complete",
        "step2-merged": f"incomplete: no {MANIFEST}: the merge did not finish (or ckptavg did not write it)",
    }
    # Never selected, never overwritten unasked (it could be any folder --out points at).
    assert [c.step for c in ckptavg.select(f"{remote}/run", last=2).checkpoints] == [1, 2]
    with pytest.raises(CkptavgError, match=f"already exists but has no {MANIFEST}.*pass --force"):
        ckptavg.merge(f"{remote}/run", last=2)
    ckptavg.merge(f"{remote}/run", last=2, options=MergeOptions(force=True))
    assert_mean(read_remote(f"{remote}/run/step2-merged")[0], saved, [1, 2])
    assert statuses(f"{remote}/run")["step2-merged"] == "merged"


def test_failure_mid_write_leaves_no_manifest(tmp_path, remote, monkeypatch):
    remote_run(tmp_path, f"{remote}/run", steps=(1, 2), shards=1)
    fs = resolve(remote)[0]
    opened: list[str] = []
    real_open = type(fs)._open

    def failing_open(self, path, mode="rb", *args, **kwargs):
        if "w" in mode and "step2-merged" in path and path.endswith(".safetensors"):
            opened.append(path)
            if len(opened) == 2:  # the first shard is written; the second cannot be
                raise OSError(28, "No space left on device")
        return real_open(self, path, mode, *args, **kwargs)

    monkeypatch.setattr(type(fs), "_open", failing_open)
    with pytest.raises(CkptavgError, match="No space left on device"):
        ckptavg.merge(f"{remote}/run", last=2, options=MergeOptions(shard_size=1000))
    monkeypatch.undo()
    assert len(opened) == 2
    check, root = other_writer(f"{remote}/run")
    assert check.find(f"{root}/step2-merged") == []  # what was written is removed, manifest included
    assert "step2-merged" not in statuses(f"{remote}/run")


def test_s3_reads_are_byte_ranges_and_the_manifest_is_written_last(tmp_path, s3_prefix, s3_requests):
    saved = remote_run(tmp_path, f"{s3_prefix}/run", steps=(10, 20), shards=2)
    s3_requests.clear()
    ckptavg.merge(f"{s3_prefix}/run", last=2, options=MergeOptions(chunk_bytes=512, workers=2, shard_size=3000))
    requests = list(s3_requests.requests)
    assert_mean(read_remote(f"{s3_prefix}/run/step20-merged")[0], saved, [10, 20])

    reads = [r for r in requests if r["method"] == "GET" and r["path"].endswith(".safetensors")]
    assert reads and all(r["range"] for r in reads), [r for r in reads if not r["range"]]
    local = tmp_path / "local-run"
    sizes = sum(p.stat().st_size for s in (10, 20) for p in (local / f"step{s}").glob("*.safetensors"))
    # Each byte once: 8-byte length, header, then each tensor in 512-byte chunks; no read-ahead.
    assert sum(r["bytes"] for r in reads) == sizes
    assert len(reads) > 2 * 4  # more than the two header reads of each of the 4 files

    writes = [r for r in requests if r["method"] in ("PUT", "POST") and "/step20-merged/" in r["path"]]
    assert writes[-1]["path"].endswith(f"/{MANIFEST}")
    assert sum(r["path"].endswith(f"/{MANIFEST}") for r in writes) == 1
    # No copy of the output (fsspec's mv on S3): nothing is written outside the target folder.
    assert not [r for r in requests if r["method"] in ("PUT", "POST") and "-merged" not in r["path"]]


def test_s3_listings_are_never_stale(tmp_path, s3_prefix):
    """Another writer's files show up: ckptavg opens filesystems without cached listings."""
    remote_run(tmp_path, f"{s3_prefix}/run", steps=(1, 2), shards=1)
    assert set(statuses(f"{s3_prefix}/run")) == {"step1", "step2"}
    fs = resolve(f"{s3_prefix}/run")[0]
    assert fs.isfile(f"{resolve(s3_prefix)[1]}/run/step2/model.safetensors")
    make_run(tmp_path / "later", [3], SHAPES)
    upload(tmp_path / "later", f"{s3_prefix}/run")
    assert set(statuses(f"{s3_prefix}/run")) == {"step1", "step2", "step3"}
    assert [c.step for c in ckptavg.select(f"{s3_prefix}/run", last=3).checkpoints] == [1, 2, 3]


def test_cli_merge_and_ls_on_remote(tmp_path, remote):
    saved = remote_run(tmp_path, f"{remote}/run")
    result = cli("merge", f"{remote}/run", "--merge-step", "30", "--window", "20", "--json")
    assert result.exit_code == 0, result.output
    payload = json.loads(result.stdout)
    assert [s["step"] for s in payload["sources"]] == [20, 30]
    assert payload["output"] == display(*resolve(f"{remote}/run/step30-merged"))
    assert_mean(read_remote(f"{remote}/run/step30-merged")[0], saved, [20, 30])
    assert statuses(f"{remote}/run") == {
        "step10": "complete",
        "step20": "complete",
        "step30": "complete",
        "step30-merged": "merged",
    }
    table = cli("ls", f"{remote}/run")
    assert table.exit_code == 0 and any(
        line.split()[:2] == ["30", "step30-merged"] and line.endswith("merged") for line in table.stdout.splitlines()
    )
    fs, root = other_writer(f"{remote}/run/step30-merged")
    published = {p: fs.cat_file(p) for p in fs.find(root)}
    again = cli("merge", f"{remote}/run", "--merge-step", "30", "--window", "20")
    assert again.exit_code == 0 and "already merged, manifest matches; nothing to do" in again.output
    other = cli("merge", f"{remote}/run", "--merge-step", "30", "--window", "20", "--dtype", "fp32")
    assert other.exit_code == 1
    assert "already exists; pass --force" in other.output and "Traceback" not in other.output
    assert {p: fs.cat_file(p) for p in fs.find(root)} == published


def test_credentials_never_shown():
    assert display(*resolve("https://user:s3cr3t@example.com/runs/a")) == "https://example.com/runs/a"
    assert redact("ftp://me:p@ss@host/x and sftp://me@host/y") == "ftp://host/x and sftp://host/y"
    assert redact("s3://bucket/a@b/c") == "s3://bucket/a@b/c"  # an @ in the path is not userinfo
    assert display(*resolve("/data/a@b/run")) == "/data/a@b/run"
    with pytest.raises(CkptavgError) as error:
        resolve("nosuchproto://user:s3cr3t@host/run")
    assert "s3cr3t" not in str(error.value) and "nosuchproto://host/run" in str(error.value)
    result = cli("ls", "nosuchproto://user:s3cr3t@host/run")
    assert result.exit_code == 1 and "s3cr3t" not in result.output


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]  # closed again when this returns: connections are refused


@pytest.mark.parametrize(
    ("case", "command", "names"),
    [
        ("credentials-in-the-url", ["ls", "s3://user:s3cr3t@{bucket}/run"], "s3:// URLs take no user or password"),
        ("credentials-in-the-url-merge", ["merge", "s3://user:s3cr3t@{bucket}/run", "--last", "2"], "take no user"),
        ("connection-refused", ["ls", "s3://{bucket}/run"], "Could not connect to the endpoint URL"),
        ("unknown-host", ["merge", "s3://{bucket}/run", "--last", "2"], "Could not connect to the endpoint URL"),
        ("access-denied", ["merge", "s3://{bucket}/run", "--last", "2"], "PermissionError: The AWS Access Key Id"),
        ("no-such-bucket", ["merge", "s3://no-such-bucket-{bucket}/run", "--last", "2"], "does not exist"),
    ],
)
def test_an_object_store_that_cannot_be_used_is_one_line_without_secrets(
    s3_server, s3_prefix, monkeypatch, tmp_path, case, command, names
):
    """The moto server on loopback stands for the store; each way of not reaching or not being
    let in ends in one ``ckptavg: error:`` line, with no traceback and no secret in it."""
    import moto.settings
    import s3fs

    make_run(tmp_path / "run", [1, 2], {"w": (8,)})
    upload(tmp_path / "run", f"{s3_prefix}/run")
    bucket = s3_prefix.removeprefix("s3://")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # botocore's retries would only repeat the failure
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "s3cr3t-key")
    if case == "connection-refused":
        monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{_closed_port()}")
    elif case == "unknown-host":
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://no-such-host.invalid")
    elif case == "access-denied":
        monkeypatch.setattr(moto.settings, "INITIAL_NO_AUTH_ACTION_COUNT", 0)  # IAM enforced: keys unknown
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        result = run_cli_in_process(*[word.format(bucket=bucket) for word in command])
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    output = result.stdout + result.stderr
    assert result.returncode == 1 and len(output.splitlines()) == 1, output
    assert output.startswith("ckptavg: error: ") and names in output, output
    assert "s3cr3t" not in output and "Traceback" not in output


# -- two merges into one output: exactly one publishes, nothing of the other's is written over ----


def _start_other_merge(monkeypatch: pytest.MonkeyPatch, where: str, other: Callable[[], None]) -> dict:
    """Run ``other`` once, just after this process's merge calls ``where`` (a function of
    ``ckptavg.merging.job`` or a method of ``AtomicFolder``, patched). Returns {"done": bool}."""
    import ckptavg.merging.job as job
    from ckptavg.merging.publish import AtomicFolder

    owner, name = (AtomicFolder, where) if hasattr(AtomicFolder, where) else (job, where)
    real, state = getattr(owner, name), {"done": False}

    def then_other(*args, **kwargs):
        value = real(*args, **kwargs)
        if not state["done"]:
            state["done"] = True  # the other merge's own calls pass through
            other()
        return value

    monkeypatch.setattr(owner, name, then_other)
    return state


@pytest.mark.parametrize("theirs", ["published", "writing"])
def test_a_merge_starting_beside_another_writes_nothing_over_it(tmp_path, remote, monkeypatch, theirs):
    """A found the output free; before A's first write another merge B published there, or
    claimed it and is still writing. A's claim (created only if absent) fails or finds B's files:
    one line, and A writes and removes nothing of B's."""
    from ckptavg.merging.publish import AtomicFolder

    remote_run(tmp_path, f"{remote}/run", steps=(1, 2, 3), shards=1)
    out = f"{remote}/out"
    fs, root = other_writer(out)
    held: list[AtomicFolder] = []

    def other() -> None:
        if theirs == "published":
            ckptavg.merge(f"{remote}/run", last=2, out=out)
        else:
            held.append(AtomicFolder(*resolve(out)).__enter__())

    state = _start_other_merge(monkeypatch, "_clear_in_place", other)
    said = f"output {display(*resolve(out))} is being written, or was just written, by another merge"
    with pytest.raises(OutputError, match=re.escape(said)):
        ckptavg.merge(f"{remote}/run", last=3, out=out)
    monkeypatch.undo()
    assert state["done"]
    if theirs == "published":
        merged, files = read_remote(out)
        assert [s["step"] for s in json.loads(files[MANIFEST])["sources"]] == [2, 3]
        assert_manifest(files, remote.split("://")[0] + "://")
    else:
        assert [p.rsplit("/", 1)[1] for p in fs.find(root)] == [".ckptavg-owner.json"]  # B's claim, as B made it
        held[0].__exit__(None, None, None)
        check, _ = other_writer(out)  # no listing cached before B left
        assert check.find(root) == []


def test_a_merge_whose_output_another_took_over_publishes_and_removes_nothing(tmp_path, remote, monkeypatch):
    """While A writes, B (--force) takes the output over and publishes. Object stores have no
    locks, so A cannot stop that; but A checks its claim before its manifest: it fails in one line,
    and neither writes a manifest over B's nor removes B's files."""
    remote_run(tmp_path, f"{remote}/run", steps=(1, 2, 3), shards=1)
    out = f"{remote}/out"
    expected: dict[str, dict[str, bytes]] = {}

    def other() -> None:
        ckptavg.merge(f"{remote}/run", last=2, out=out, options=MergeOptions(force=True))
        expected["files"] = read_remote(out)[1]

    state = _start_other_merge(monkeypatch, "_prune", other)
    said = f"output {display(*resolve(out))} was taken over by another merge while this one ran"
    with pytest.raises(OutputError, match=re.escape(said)):
        ckptavg.merge(f"{remote}/run", last=3, out=out)
    monkeypatch.undo()
    assert state["done"] and read_remote(out)[1] == expected["files"]

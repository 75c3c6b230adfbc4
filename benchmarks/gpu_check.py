"""The training hook on a GPU in one command (``make gpu-check``): is the merge right, what does it cost?

A GPT of about ``--params`` parameters (default 1e9; bench_hook's model, in bf16) trains with
AdamW for ``--warmup`` + ``--steps`` steps, twice on the same model: without the hook, then with
``MergeHook(mode="accumulate", every=1)`` capturing every step into one window that ends at the
last step.

Correctness. While the hooked run trains, each step's weights are also summed on the device, in
float64 and in the hook's own accumulator (fp32 for bf16 weights; fp64 for fp32 weights, run with
``float64_accumulator=True``), starting from a copy as the hook does. The merge must equal that
mirrored sum's correctly rounded mean bit for bit (the capture delivered every step's exact
weights), lie within one ulp of the correctly rounded float64 mean everywhere and equal it for at
least 99.99 % of the elements (fp32 sums of bf16 values are exact unless one element's values
span many binades; docs/internals.md, "Precision"). Any failure exits with status 1.

Overhead. A step's time is forward, backward and optimizer step plus the hook call, with the
training stream synchronised around each (``current_stream().synchronize()``: a device-wide sync
would also wait for the hook's copy on its side stream, which in training runs alongside the next
forward pass, and the optimizer step waits for it on the device if it must). The reference sums
run between the optimizer step and the hook call, outside the time, while no copy is in flight.
Reported: the median step with and without the hook, and the median hook call (the training
thread's own wait: at most the launch of the copies, unless both host buffer sets are still
being read by the background thread).

``--device cpu --params 2e6 --steps 6`` is a smoke run of the same code (in ``make test``).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.append(str(HERE.parent / "tests"))  # references.py: the exactness references of the tests

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from bench_hook import build_model  # noqa: E402
from references import correctly_rounded, load_merged, same_bits  # noqa: E402

from ckptavg import MergeHook, MergeHookConfig  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
# The hook's running sums: fp32 for 16-bit weights; fp64 for fp32 weights (float64_accumulator=True).
SUM_DTYPES = {torch.bfloat16: torch.float32, torch.float32: torch.float64}
MIN_EXACT_FRACTION = 0.9999
HEAD_SIZE = 128
BATCH = {"cuda": (8, 1024), "cpu": (2, 32)}  # sequences x tokens per step


def gpt_shape(params: float) -> tuple[int, int, int, int]:
    """(width, layers, vocab, heads) of bench_hook's GPT nearest to ``params`` parameters: about
    one layer per 112 of width, as GPT-style models of ~1B have (2048 wide, 18 layers)."""
    vocab = 32000 if params >= 1e8 else 4096

    def layers(width: int) -> int:
        return max(1, round(width / 112))

    def count(width: int) -> int:  # per block: 2 LayerNorms, qkv, proj, a 4x MLP; + embedding, norm, head
        return layers(width) * (12 * width**2 + 13 * width) + 2 * vocab * width + 2 * width

    width = min(range(HEAD_SIZE, 16384 + 1, HEAD_SIZE), key=lambda w: abs(count(w) - params))
    return width, layers(width), vocab, width // HEAD_SIZE


class DeviceSums:
    """Every step's weights summed where they live: in float64, and in the hook's accumulator."""

    def __init__(self) -> None:
        self.steps = 0
        self.float64: dict[str, torch.Tensor] = {}
        self.mirrored: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def add(self, model: torch.nn.Module) -> None:
        for name, tensor in model.state_dict().items():
            self._fold(self.float64, name, tensor, torch.float64)
            if SUM_DTYPES[tensor.dtype] != torch.float64:
                self._fold(self.mirrored, name, tensor, SUM_DTYPES[tensor.dtype])
        self.steps += 1

    def _fold(self, sums: dict[str, torch.Tensor], name: str, tensor: torch.Tensor, dtype: torch.dtype) -> None:
        if self.steps == 0:  # a copy, as the hook starts (0.0 + -0.0 would be +0.0)
            sums[name] = tensor.to(dtype, copy=True)
        else:
            sums[name].add_(tensor)

    def mirror(self, name: str) -> torch.Tensor:
        return self.mirrored.get(name, self.float64[name])


def ulps_apart(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Elementwise count of representable values from ``a`` to ``b`` (same float dtype)."""
    bits = 8 * a.element_size()
    view = {16: torch.int16, 32: torch.int32}[bits]

    def ordered(x: torch.Tensor) -> torch.Tensor:
        raw = x.contiguous().view(view).to(torch.int64)
        magnitude = raw & (2 ** (bits - 1) - 1)
        return torch.where(raw < 0, -magnitude, magnitude)

    return (ordered(a) - ordered(b)).abs()


def check_merge(folder: Path, sums: DeviceSums, device: str) -> dict:
    """The merged output against the sums kept on the device (see the module docstring)."""
    merged = load_merged(folder)
    elements = mirror_differs = exact = max_ulps = 0
    for name in sorted(set(merged) & set(sums.float64)):
        out = merged[name].to(device)
        mirrored = correctly_rounded(sums.mirror(name).double() / sums.steps, out.dtype)
        mean = correctly_rounded(sums.float64[name] / sums.steps, out.dtype)
        elements += out.numel()
        mirror_differs += int((~same_bits(out, mirrored)).sum())
        exact += int(same_bits(out, mean).sum())
        max_ulps = max(max_ulps, int(ulps_apart(out, mean).max()))
    names_differ = sorted(set(merged) ^ set(sums.float64))
    exact_fraction = exact / max(elements, 1)
    ok = not names_differ and mirror_differs == 0 and max_ulps <= 1 and exact_fraction >= MIN_EXACT_FRACTION
    return {
        "ok": ok,
        "elements": elements,
        "mirror_differs": mirror_differs,
        "exact_fraction": exact_fraction,
        "max_ulps": max_ulps,
        "tensors_missing_or_unexpected": names_differ,
    }


def train(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    args: argparse.Namespace,
    vocab: int,
    hook: MergeHook | None = None,
    sums: DeviceSums | None = None,
) -> tuple[list[float], list[float]]:
    """Train warm-up + measured steps; the measured steps' times and hook-call times (seconds)."""

    def sync() -> None:
        if args.device == "cuda":
            torch.cuda.current_stream().synchronize()  # the training stream only (module docstring)

    step_times, call_times = [], []
    for step in range(1, args.warmup + args.steps + 1):
        generator = torch.Generator(args.device).manual_seed(step)
        tokens = torch.randint(0, vocab, (args.batch, args.seq + 1), generator=generator, device=args.device)
        sync()
        start = time.perf_counter()
        logits = model(tokens[:, :-1])
        F.cross_entropy(logits.reshape(-1, vocab).float(), tokens[:, 1:].reshape(-1)).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        stepped = time.perf_counter()
        if sums is not None:
            sums.add(model)
            sync()
        called = time.perf_counter()
        if hook is not None:
            hook.post_train_batch(step, model)
        sync()
        done = time.perf_counter()
        if step > args.warmup:
            step_times.append(stepped - start + done - called)
            call_times.append(done - called)
    return step_times, call_times


def ms(seconds: float) -> str:
    return f"{seconds * 1e3:9.1f} ms"


def parse(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    parser.add_argument("--params", type=float, default=1e9, help="model size, e.g. 1e9 or 2e6")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16")
    parser.add_argument("--steps", type=int, default=50, help="measured steps per run")
    parser.add_argument("--warmup", type=int, default=5, help="steps before the measured ones")
    parser.add_argument("--batch", type=int, help="sequences per step (cuda: 8, cpu: 2)")
    parser.add_argument("--seq", type=int, help="tokens per sequence (cuda: 1024, cpu: 32)")
    parser.add_argument("--tmp", help="where the merge is written (default: the system's temporary folder)")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        raise SystemExit(
            f"gpu_check: error: --device cuda, but torch {torch.__version__} sees no CUDA device "
            "(a GPU and a CUDA build of torch are needed; --device cpu runs the smoke version)"
        )
    if args.steps < 1 or args.warmup < 0:
        raise SystemExit(f"gpu_check: error: --steps must be >= 1 and --warmup >= 0, got {args.steps}, {args.warmup}")
    args.batch = args.batch or BATCH[args.device][0]
    args.seq = args.seq or BATCH[args.device][1]
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse(argv)
    dtype = DTYPES[args.dtype]
    width, layers, vocab, heads = gpt_shape(args.params)
    with torch.device(args.device):
        model = build_model(width, layers, vocab, heads).to(dtype)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    params = sum(p.numel() for p in model.parameters())
    where = f"cuda ({torch.cuda.get_device_name()})" if args.device == "cuda" else "cpu"
    total = args.warmup + args.steps
    print(
        f"ckptavg gpu-check: GPT of {params / 1e6:,.1f}M parameters (width {width}, {layers} layers, vocab {vocab}), "
        f"{args.dtype}, AdamW, batch {args.batch}x{args.seq}, on {where}; {args.steps} measured steps after "
        f'{args.warmup} warm-up steps; MergeHook(mode="accumulate", every=1) over all {total} steps'
    )
    without, _ = train(model, optimizer, args, vocab)
    sums = DeviceSums()
    with tempfile.TemporaryDirectory(prefix="ckptavg-gpu-check-", dir=args.tmp) as folder:
        config = MergeHookConfig(
            save_folder=folder, merge_steps=[total], window=total, float64_accumulator=dtype == torch.float32
        )
        hook = MergeHook(config)
        hook.pre_train(0)
        with_hook, calls = train(model, optimizer, args, vocab, hook, sums)
        closing = time.perf_counter()
        hook.close()
        merge_s = time.perf_counter() - closing
        verdict = check_merge(Path(folder) / f"step{total}-merged", sums, args.device)
    none, hooked, call = statistics.median(without), statistics.median(with_hook), statistics.median(calls)
    overhead = hooked - none
    print(f"\n{'':<22}{'median step':>14}{'hook call':>14}")
    print(f"{'no hook':<22}{ms(none)}{'-':>14}")
    print(f"{'accumulate, every=1':<22}{ms(hooked)}{ms(call)}")
    print(f"{'overhead':<22}{ms(overhead)}  ({overhead / none:+.1%})")
    print(f"the merge was written {merge_s:.1f} s after the last step")
    print(
        f"\ncorrectness of step{total}-merged ({verdict['elements']:,} elements): "
        f"{verdict['mirror_differs']:,} differ from the mean of the hook's own sums mirrored on the device; "
        f"{verdict['exact_fraction']:.4%} equal the correctly rounded float64 mean, none is more than "
        f"{verdict['max_ulps']} ulp from it; tensors missing or unexpected: "
        f"{', '.join(verdict['tensors_missing_or_unexpected']) or 'none'}: {'PASS' if verdict['ok'] else 'FAIL'}"
    )
    record = {
        "device": where,
        "params": params,
        "dtype": args.dtype,
        "steps": args.steps,
        "warmup": args.warmup,
        "median_step_s": {"none": none, "accumulate": hooked},
        "overhead_s": overhead,
        "overhead_fraction": overhead / none,
        "median_hook_call_s": call,
        "merge_s": merge_s,
        "correct": verdict["ok"],
        "check": verdict,
    }
    print(json.dumps(record))
    if not verdict["ok"]:
        sys.exit(1)


if __name__ == "__main__":
    main()

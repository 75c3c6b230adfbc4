"""How much each step of a window counts in its average: pure functions, shared by
``ckptavg merge`` and the training hook so that both give one answer for one window.

Weights are computed for the steps a merge averages, in ascending step order, then normalised
to sum to 1 (:func:`normalised`: exactly rounded, and safe from overflow). Schemes:

* ``uniform`` (SMA, default): every step the same.
* ``ema``: ``beta ** (last_step - step)`` with ``beta = 1 - alpha`` or ``0.5 ** (1 / halflife)``,
  computed in log space, so that a half-life of 1e-4 steps (beta underflows to 0) weighs the
  newest step alone instead of failing;
  measured in *training steps*, not in checkpoints, so a strided window weighs each saved step
  as the same EMA would. Normalised, it equals a bias-corrected EMA started at the window's
  first step (Adam's correction), which is what the hook keeps running.
* ``wma``: linearly increasing, the ``i``-th of ``n`` checkpoints weighs ``i`` (PMA, arXiv
  2505.12082).
* ``wsm`` (``wsm:SHAPE``, arXiv 2507.17634): the weights that make the average act like a decay
  of ``SHAPE`` over the window. Averaging iterates taken at a constant learning rate applies
  gradient ``k`` with the tail sum of the weights after it (uniform weights act like a linear
  cooldown), so the checkpoint at position ``x_i`` gets the decay's drop over its interval:
  Megatron-LM's recurrence (``tools/checkpoint/weighted_merge.py``), ``d[i] = f(x_i)``,
  ``c[N-1] = d[N-1]``, ``c[i] = d[i] - d[i+1]`` (0 < i < N-1), ``c[0] = 1 - d[1]``, with
  ``x_i = i/N`` (``positions="index"``) or placed by step (``positions="steps"``: see
  :func:`step_positions`). ``reverse`` gives the oldest checkpoint the newest one's weight and so
  on (Megatron's ``__reverse``, for ablations). Shapes: :data:`WSM_SHAPES`.
* ``minus-sqrt``: ``wsm:1-sqrt`` by another name (the same numbers, one formula):
  ``sqrt(i/n) - sqrt((i-1)/n)`` up to rounding, the cooldown Hägele et al. 2024 found best. It
  drops fastest at its start, so these weights favour the *older* checkpoints of the window.
* ``explicit``: the user's numbers, one per averaged checkpoint; negative ones only with
  ``allow_negative`` (extrapolation, subtractive merges), and never summing to zero.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from .errors import ConfigError

SCHEMES = ("uniform", "ema", "wma", "minus-sqrt", "wsm", "explicit")
WSM_SHAPES = ("linear", "1-sqrt", "cosine", "poly:P")
"""Decay shapes ``f(x)`` of ``wsm``, x from 0 to 1: ``1 - x``, ``1 - sqrt(x)``, ``(1 + cos(pi x)) / 2``,
``1 - x^P`` (P > 0)."""
POSITIONS = ("index", "steps")
# Below this, -log(2) / halflife (the log of the per-step decay) overflows a float.
MIN_EMA_HALFLIFE = 1e-300


def normalised(weights: Sequence[float], allow_negative: bool = False) -> list[float]:
    """``weights`` divided by their sum; they must be finite and non-negative, not all zero (with
    ``allow_negative``: finite, of a sum that is not zero, and of finite ratios to it).

    The sum is taken of the weights scaled by a power of two (:func:`_scaled`), which is exact
    and changes no quotient: 1e308,1e308 gives 0.5,0.5 instead of overflowing. ``math.fsum``
    rounds the exact sum once, so it is zero only where the weights cancel exactly."""
    check_weights(weights, "weights", allow_negative)
    scaled = _scaled(weights)
    total = math.fsum(scaled)
    ratios = [w / total for w in scaled]
    if not all(map(math.isfinite, ratios)):  # a sum some 2**1000 times below the largest weight
        raise ConfigError(f"weights {_listed(weights)} sum too near zero: their ratios to the sum overflow")
    return ratios


def check_weights(weights: Sequence[float], what: str, allow_negative: bool = False) -> None:
    """Refuse weights no mean can be taken with: none, not finite, negative (unless
    ``allow_negative``: extrapolation), all zero, or (negative ones allowed) summing to zero."""
    if not weights or any(not math.isfinite(w) for w in weights) or not any(weights):
        raise ConfigError(f"{what} must be finite and not all zero, got {_listed(weights)}")
    if not allow_negative and min(weights) < 0:
        raise ConfigError(
            f"{what} must be non-negative, got {_listed(weights)}; negative weights extrapolate, "
            "which --allow-negative-weights permits"
        )
    if math.fsum(_scaled(weights)) == 0:
        raise ConfigError(f"{what} {_listed(weights)} sum to zero: a weighted mean divides by their sum")


def _scaled(weights: Sequence[float]) -> list[float]:
    """The weights times the power of two that brings the largest magnitude into [0.5, 1): exact,
    the same ratios, and no sum of them overflows."""
    exponent = math.frexp(max(abs(w) for w in weights))[1]
    return [math.ldexp(w, -exponent) for w in weights]


def _decay(shape: str, x: float) -> float:
    """The decay ``f(x)`` of a ``wsm`` shape (checked), 1 at x = 0 and 0 at x = 1."""
    if shape == "linear":
        return 1.0 - x
    if shape == "1-sqrt":
        return 1.0 - math.sqrt(x)
    if shape == "cosine":
        return (1.0 + math.cos(math.pi * x)) / 2.0
    return 1.0 - x ** _poly_power(shape)


def wsm_coefficients(shape: str, positions: Sequence[float]) -> list[float]:
    """Megatron-LM's recurrence over the decay ``f`` of ``shape`` at ``positions`` (x_0 = 0 <
    x_1 < ... < x_{N-1} < 1): ``d[i] = f(x_i)``, ``c[N-1] = d[N-1]``, ``c[i] = d[i] - d[i+1]`` for
    0 < i < N-1, ``c[0] = 1 - d[1]``; one checkpoint weighs 1. Checkpoint ``i`` gets the drop of
    the decay over its interval (the last one the drop to 0), so the ``c`` sum to 1."""
    if len(positions) <= 1:
        return [1.0] * len(positions)
    d = [_decay(shape, x) for x in positions]
    last = len(d) - 1
    return [1.0 - d[1]] + [d[i] - d[i + 1] for i in range(1, last)] + [d[last]]


def step_positions(steps: Sequence[int]) -> list[float]:
    """``x_i = (N-1)(s_i - s_0) / (N (s_{N-1} - s_0))``: where ``wsm`` with ``positions="steps"``
    places the checkpoints at steps ``s_0 < ... < s_{N-1}``.

    The window is taken to span its steps plus one mean gap, as ``N`` evenly spaced checkpoints
    span ``N`` gaps: evenly spaced steps give exactly ``i/N``, the index positions (one division of
    exact integers, correctly rounded, as ``i / N`` is), and the last checkpoint always sits at
    ``(N-1)/N``, so it weighs what it weighs by index."""
    n, first, span = len(steps), steps[0], steps[-1] - steps[0]
    if n == 1:
        return [0.0]
    return [(n - 1) * (s - first) / (n * span) for s in steps]


def _poly_power(shape: str) -> float:
    return float(shape.split(":", 1)[1])


def _wsm_shape(shape: str | None) -> str:
    """``shape`` checked and spelled one way (``poly:2.0`` is ``poly:2``)."""
    if shape in ("linear", "1-sqrt", "cosine"):
        return shape
    if isinstance(shape, str) and shape.startswith("poly:"):
        try:
            power = float(shape[5:])
        except ValueError:
            power = math.nan
        if math.isfinite(power) and power > 0:
            return f"poly:{tag_number(power)}"
        raise ConfigError(f"wsm shape {shape!r}: P of poly:P must be a finite number above 0")
    raise ConfigError(f"unknown wsm shape {shape!r} (choose from {', '.join(WSM_SHAPES)})")


def _listed(values: Sequence[float], sep: str = ",", most: int = 10) -> str:
    """``1,2,3`` or, for a long list, its first ``most`` and a count: a message stays one short line."""
    shown = sep.join(map(str, values[:most]))
    return shown if len(values) <= most else f"{shown}{sep}... ({len(values)} in all)"


def tag_number(value: float) -> str:
    """``20`` for 20.0, else the shortest text that reads back as the same float: two
    parameters give one tag only when they are equal."""
    text = repr(float(value))
    return text.removesuffix(".0")


@dataclass(frozen=True)
class Weighting:
    """A weighting scheme and its parameters; checked when built.

    Example::

        Weighting("ema", ema_halflife=50)  # or Weighting.from_options(weights=[1, 2, 4])
    """

    scheme: str = "uniform"
    """One of :data:`SCHEMES`: ``uniform``, ``ema``, ``wma``, ``minus-sqrt``, ``wsm``, ``explicit``."""
    ema_alpha: float | None = None
    """``ema``: the weight of the newest step; earlier steps decay by ``1 - alpha`` per step."""
    ema_halflife: float | None = None
    """``ema``, instead of ``ema_alpha``: training steps after which a step's weight halves."""
    explicit: tuple[float, ...] | None = None
    """``explicit``: one weight per averaged checkpoint, in ascending step order."""
    shape: str | None = None
    """``wsm``: the decay shape, one of :data:`WSM_SHAPES` (``poly:2``)."""
    positions: str = "index"
    """``wsm``: where the checkpoints sit in the decay, by their place (``index``: ``x_i = i/N``,
    Megatron's) or by their training steps (``steps``: :func:`step_positions`)."""
    reverse: bool = False
    """``wsm``: the coefficients in reverse order (the newest checkpoint weighs what the oldest
    would): Megatron's ``__reverse`` modifier, for ablations."""
    allow_negative: bool = field(default=False, compare=False)
    """``explicit``: accept negative weights (``--allow-negative-weights``). A permission, not
    part of the weighting: the same numbers are the same merge with or without it."""

    @classmethod
    def parse(cls, text: str, **parameters: Any) -> Weighting:
        """A weighting from its command-line name: ``uniform``, ``wma``, ``minus-sqrt``, ``ema``
        (with ``ema_alpha`` or ``ema_halflife`` among ``parameters``), ``wsm:SHAPE`` with SHAPE one
        of :data:`WSM_SHAPES` and an optional ``:reverse`` (``wsm:1-sqrt``, ``wsm:poly:2:reverse``).
        ``positions`` among ``parameters`` goes to ``wsm`` only."""
        name, _, rest = text.partition(":")
        positions = parameters.pop("positions", None)
        if name != "wsm":
            if rest:
                raise ConfigError(f"weighting {text!r}: only wsm takes a shape (wsm:1-sqrt)")
            return cls(name, **parameters)
        reverse = rest == "reverse" or rest.endswith(":reverse")
        shape = rest.removesuffix("reverse").removesuffix(":") if reverse else rest
        if not shape:
            raise ConfigError(
                f"weighting {text!r} needs a decay shape: wsm:SHAPE, SHAPE one of {', '.join(WSM_SHAPES)}"
            )
        return cls("wsm", shape=shape, positions=positions or "index", reverse=reverse, **parameters)

    def __post_init__(self) -> None:
        # One weighting, one spelling: 20 and 20.0 must describe (and fingerprint) one merge.
        for name in ("ema_alpha", "ema_halflife"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        if self.explicit is not None:
            object.__setattr__(self, "explicit", tuple(float(w) for w in self.explicit))
        if self.scheme == "wsm":
            object.__setattr__(self, "shape", _wsm_shape(self.shape))
            if self.positions not in POSITIONS:
                raise ConfigError(f"wsm positions must be one of {', '.join(POSITIONS)}, got {self.positions!r}")
        elif self.shape is not None or self.positions != "index" or self.reverse:
            raise ConfigError(f"a decay shape, positions and reverse apply to the wsm weighting, not {self.scheme!r}")
        if self.scheme not in SCHEMES:
            raise ConfigError(f"unknown weighting {self.scheme!r} (choose from {', '.join(SCHEMES)})")
        ema_given = self.ema_alpha is not None or self.ema_halflife is not None
        if self.scheme == "ema":
            if (self.ema_alpha is None) == (self.ema_halflife is None):
                raise ConfigError("EMA needs exactly one of --ema-alpha or --ema-halflife")
            if self.ema_alpha is not None and not 0 < self.ema_alpha < 1:
                raise ConfigError(f"--ema-alpha must lie strictly between 0 and 1, got {self.ema_alpha}")
            if self.ema_halflife is not None and not MIN_EMA_HALFLIFE <= self.ema_halflife < math.inf:
                raise ConfigError(
                    f"--ema-halflife must be a finite number of steps of at least {MIN_EMA_HALFLIFE:g}, "
                    f"got {self.ema_halflife}"
                )
        elif ema_given:
            raise ConfigError(f"--ema-alpha/--ema-halflife apply to the ema weighting, not {self.scheme!r}")
        if self.scheme == "explicit":
            if not self.explicit:
                raise ConfigError("explicit weighting needs --weights w1,w2,...")
            check_weights(self.explicit, "--weights", self.allow_negative)
        elif self.explicit is not None:
            raise ConfigError(f"--weights gives explicit weights; it cannot be combined with {self.scheme!r}")

    @classmethod
    def from_options(
        cls,
        scheme: str | None = None,
        ema_alpha: float | None = None,
        ema_halflife: float | None = None,
        weights: Sequence[float] | None = None,
        allow_negative_weights: bool = False,
        positions: str | None = None,
    ) -> Weighting:
        """The command line's options, where ``--ema-*`` implies ``ema`` and ``--weights``
        implies ``explicit``; ``scheme`` is a name :meth:`parse` reads (``wsm:1-sqrt``)."""
        if scheme is None:
            if weights is not None:
                scheme = "explicit"
            elif ema_alpha is not None or ema_halflife is not None:
                scheme = "ema"
            else:
                scheme = "uniform"
        if positions is not None and not scheme.startswith("wsm:"):
            raise ConfigError(f"--positions applies to the wsm weighting, not {scheme!r}")
        return cls.parse(
            scheme,
            ema_alpha=ema_alpha,
            ema_halflife=ema_halflife,
            explicit=None if weights is None else tuple(weights),
            allow_negative=allow_negative_weights,
            positions=positions,
        )

    @property
    def uniform(self) -> bool:
        return self.scheme == "uniform"

    @property
    def needs_steps(self) -> bool:
        """Whether the weights depend on the training steps (``ema``: a decay per step; ``wsm``
        placed by steps), not only on each checkpoint's place in the window."""
        return self.scheme == "ema" or self.positions == "steps"

    @property
    def ema_decay(self) -> float:
        """``beta``: the factor by which a step's weight shrinks per later training step (for
        the manifest; the weights come from :attr:`ema_log_decay`)."""
        if self.ema_alpha is not None:
            return 1.0 - self.ema_alpha
        assert self.ema_halflife is not None
        return 0.5 ** (1.0 / self.ema_halflife)

    @property
    def ema_log_decay(self) -> float:
        """``log(beta)``, finite for every accepted parameter: taken without forming ``beta``,
        which underflows to 0 for a half-life below about 1e-3 steps."""
        if self.ema_alpha is not None:
            return math.log1p(-self.ema_alpha)
        assert self.ema_halflife is not None
        return -math.log(2.0) / self.ema_halflife

    def raw(self, steps: Sequence[int]) -> list[float]:
        """Unnormalised weights of ``steps`` (ascending, distinct); their ratios are the scheme."""
        if not steps:
            raise ConfigError("no steps to weigh")
        if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
            raise ConfigError(f"steps must be ascending and distinct, got {list(steps)}")
        n = len(steps)
        if self.scheme == "uniform":
            return [1.0] * n
        if self.scheme == "ema":
            # log-space so that a long window cannot overflow; the newest step weighs 1.
            return [math.exp(self.ema_log_decay * (steps[-1] - s)) for s in steps]
        if self.scheme == "wma":
            return [float(i) for i in range(1, n + 1)]
        if self.scheme == "minus-sqrt":
            return wsm_coefficients("1-sqrt", [i / n for i in range(n)])
        if self.scheme == "wsm":
            assert self.shape is not None  # checked when built
            where = step_positions(steps) if self.positions == "steps" else [i / n for i in range(n)]
            coefficients = wsm_coefficients(self.shape, where)
            return coefficients[::-1] if self.reverse else coefficients
        return self.explicit_for(n, steps)

    def explicit_for(self, count: int, steps: Sequence[int] | None = None) -> list[float]:
        """The explicit weights of ``count`` checkpoints (at ``steps``, if known, for the message),
        scaled by a power of two (:func:`_scaled`) so that running sums of them cannot overflow."""
        assert self.explicit is not None
        if len(self.explicit) != count:
            at = "" if steps is None else f" (steps {_listed(steps, ', ')})"
            raise ConfigError(f"--weights gives {len(self.explicit)} weights for {count} checkpoints{at}")
        return _scaled(self.explicit)

    def running(self, steps: Sequence[int], index: int) -> tuple[float, float]:
        """``(decay, weight)`` for folding step ``steps[index]`` into a running sum as
        ``sum = decay * sum + weight * x`` (and the total weight the same way).

        The hook keeps such sums while training runs; folded over every step of the window
        they equal :meth:`raw`'s weighted sum (up to one common factor), so ``sum / total`` is
        this scheme's average. For ``ema`` this is a running EMA that decays by ``beta`` per
        training step, updated only at the captured steps."""
        n = len(steps)
        if not 0 <= index < n:
            raise ConfigError(f"step index {index} outside a window of {n} steps")
        if self.scheme == "ema":
            gap = 0 if index == 0 else steps[index] - steps[index - 1]
            return math.exp(self.ema_log_decay * gap), 1.0
        if self.scheme == "wma":
            return 1.0, float(index + 1)
        if self.scheme == "uniform":
            return 1.0, 1.0
        return 1.0, self.raw(steps)[index]

    def weights(self, steps: Sequence[int]) -> list[float]:
        """Normalised weights of ``steps`` (sum 1 up to rounding)."""
        return normalised(self.raw(steps), self.allow_negative)

    def tag(self) -> str:
        """A short name that tells this weighting from others in a folder name: ``uniform``,
        ``ema20`` (half-life 20 steps), ``ema-alpha0.1``, ``wma``, ``minus-sqrt``, ``wsm-1-sqrt``
        (``wsm-poly2``, ``wsm-cosine-steps``, ``wsm-linear-reverse``), ``explicit``.
        Outputs of several weightings of one window are named ``step{S}-merged-<tag>``."""
        if self.ema_halflife is not None:
            return f"ema{tag_number(self.ema_halflife)}"
        if self.ema_alpha is not None:
            return f"ema-alpha{tag_number(self.ema_alpha)}"
        if self.scheme == "wsm":
            assert self.shape is not None  # checked when built
            parts = [
                self.shape.replace(":", ""),
                "steps" if self.positions == "steps" else "",
                "reverse" * self.reverse,
            ]
            return "-".join(["wsm", *filter(None, parts)])
        return self.scheme

    def describe(self) -> dict[str, Any]:
        """The scheme and its parameters, for the manifest."""
        info: dict[str, Any] = {"scheme": self.scheme}
        if self.scheme == "ema":
            info["ema_decay_per_step"] = self.ema_decay
            if self.ema_alpha is not None:
                info["ema_alpha"] = self.ema_alpha
            else:
                info["ema_halflife_steps"] = self.ema_halflife
        if self.scheme == "wsm":
            info.update(shape=self.shape, positions=self.positions, reverse=self.reverse)
        if self.explicit is not None:
            info["given"] = list(self.explicit)
        return info

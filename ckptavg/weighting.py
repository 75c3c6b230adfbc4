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
* ``minus-sqrt``: ``sqrt(i/n) - sqrt((i-1)/n)``. Why this shape: averaging iterates taken at a
  constant learning rate applies gradient ``k`` with the tail sum of the weights after it, so
  uniform weights act like a linear cooldown over the window; these weights make that tail sum
  ``1 - sqrt(k/n)``, the cooldown Hägele et al. 2024 found best. That cooldown drops fastest
  at its start, so these weights favour the *older* checkpoints of the window.
* ``explicit``: the user's numbers, one per averaged checkpoint.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from .errors import ConfigError

SCHEMES = ("uniform", "ema", "wma", "minus-sqrt", "explicit")
# Below this, -log(2) / halflife (the log of the per-step decay) overflows a float.
MIN_EMA_HALFLIFE = 1e-300


def normalised(weights: Sequence[float]) -> list[float]:
    """``weights`` divided by their sum; they must be finite and non-negative, not all zero.

    The sum is taken of the weights scaled by a power of two (:func:`_scaled`), which is exact
    and changes no quotient: 1e308,1e308 gives 0.5,0.5 instead of overflowing."""
    if not weights or any(not math.isfinite(w) or w < 0 for w in weights) or max(weights) == 0:
        raise ConfigError(f"weights must be finite, non-negative and not all zero, got {_listed(weights)}")
    scaled = _scaled(weights)
    total = math.fsum(scaled)
    return [w / total for w in scaled]


def _scaled(weights: Sequence[float]) -> list[float]:
    """The weights times the power of two that brings the largest into [0.5, 1): exact, the same
    ratios, and no sum of them overflows."""
    exponent = math.frexp(max(weights))[1]
    return [math.ldexp(w, -exponent) for w in weights]


def _listed(values: Sequence[float], sep: str = ",", most: int = 10) -> str:
    """``1,2,3`` or, for a long list, its first ``most`` and a count: a message stays one short line."""
    shown = sep.join(map(str, values[:most]))
    return shown if len(values) <= most else f"{shown}{sep}... ({len(values)} in all)"


def _number(value: float) -> str:
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
    """One of :data:`SCHEMES`: ``uniform``, ``ema``, ``wma``, ``minus-sqrt``, ``explicit``."""
    ema_alpha: float | None = None
    """``ema``: the weight of the newest step; earlier steps decay by ``1 - alpha`` per step."""
    ema_halflife: float | None = None
    """``ema``, instead of ``ema_alpha``: training steps after which a step's weight halves."""
    explicit: tuple[float, ...] | None = None
    """``explicit``: one weight per averaged checkpoint, in ascending step order."""

    def __post_init__(self) -> None:
        # One weighting, one spelling: 20 and 20.0 must describe (and fingerprint) one merge.
        for name in ("ema_alpha", "ema_halflife"):
            value = getattr(self, name)
            if isinstance(value, int) and not isinstance(value, bool):
                object.__setattr__(self, name, float(value))
        if self.explicit is not None:
            object.__setattr__(self, "explicit", tuple(float(w) for w in self.explicit))
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
            if any(not math.isfinite(w) or w < 0 for w in self.explicit) or max(self.explicit) == 0:
                raise ConfigError(
                    f"--weights must be finite, non-negative and not all zero, got {_listed(self.explicit)}"
                )
        elif self.explicit is not None:
            raise ConfigError(f"--weights gives explicit weights; it cannot be combined with {self.scheme!r}")

    @classmethod
    def from_options(
        cls,
        scheme: str | None = None,
        ema_alpha: float | None = None,
        ema_halflife: float | None = None,
        weights: Sequence[float] | None = None,
    ) -> Weighting:
        """The command line's options, where ``--ema-*`` implies ``ema`` and ``--weights``
        implies ``explicit``."""
        if scheme is None:
            if weights is not None:
                scheme = "explicit"
            elif ema_alpha is not None or ema_halflife is not None:
                scheme = "ema"
            else:
                scheme = "uniform"
        return cls(scheme, ema_alpha, ema_halflife, None if weights is None else tuple(weights))

    @property
    def uniform(self) -> bool:
        return self.scheme == "uniform"

    @property
    def needs_steps(self) -> bool:
        """Whether the weights depend on the training steps (``ema``: a decay per step), not only
        on each checkpoint's place in the window."""
        return self.scheme == "ema"

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
            return [math.sqrt(i / n) - math.sqrt((i - 1) / n) for i in range(1, n + 1)]
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
        if self.scheme == "minus-sqrt":
            return 1.0, math.sqrt((index + 1) / n) - math.sqrt(index / n)
        if self.scheme == "explicit":
            return 1.0, self.raw(steps)[index]
        return 1.0, 1.0

    def weights(self, steps: Sequence[int]) -> list[float]:
        """Normalised weights of ``steps`` (sum 1 up to rounding)."""
        return normalised(self.raw(steps))

    def tag(self) -> str:
        """A short name that tells this weighting from others in a folder name: ``uniform``,
        ``ema20`` (half-life 20 steps), ``ema-alpha0.1``, ``wma``, ``minus-sqrt``, ``explicit``.
        Outputs of several weightings of one window are named ``step{S}-merged-<tag>``."""
        if self.ema_halflife is not None:
            return f"ema{_number(self.ema_halflife)}"
        if self.ema_alpha is not None:
            return f"ema-alpha{_number(self.ema_alpha)}"
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
        if self.explicit is not None:
            info["given"] = list(self.explicit)
        return info

"""timm's `auto_augment` strings, parsed into a `PolicySpec` (no numpy, no OpenCV).

`Augment` checks its string here where it is made; `pipeline.augment.policies` builds
the policy the spec names. Same grammar as timm, so a timm recipe's string works
unchanged; where timm reads `inc0` or `b0` as on (it tests `bool("0")`), the digit
here means what it says.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import re
from dataclasses import dataclass

from shards.errors import UsageError

GRAMMAR = (
    "rand[-m{M}][-n{N}][-p{P}][-mstd{S}][-mmax{X}][-inc{0|1}][-w0][-t{weights|3a|3aw}], "
    "original|originalr|v0|v0r|3a[-mstd{S}], augmix[-m{M}][-w{W}][-d{D}][-a{A}][-b{0|1}]"
    "[-mstd{S}], or trivialaugment"
)
AUTO_POLICIES = ("original", "originalr", "v0", "v0r", "3a")
RAND_CHOICES = ("weights", "3a", "3aw")  # timm's `-t` transform sets
_WEIGHTED_SIZES = {"w0": 13, "weights": 15, "3aw": 14}  # sets drawn without replacement
_SECTION = re.compile(r"^([a-z]+)(\d.*)$")  # timm's split: the letters, then from the first digit


class PolicyError(UsageError):
    """An `auto_augment` string outside the grammar; `Augment` names the field and string."""


@dataclass(frozen=True)
class PolicySpec:
    """What an `auto_augment` string asks for.

    Attributes:
        kind: `rand`, `auto` (AutoAugment's sub-policies), `augmix` or `trivial`.
        name: the AutoAugment policy (`original`, `originalr`, `v0`, `v0r`, `3a`).
        magnitude: the op magnitude, 0-10 on timm's scale (`m`).
        num_layers: RandAugment's ops per image (`n`).
        prob: RandAugment's chance that each chosen op applies (`p`).
        magnitude_std: Gaussian noise on the magnitude per op (`mstd`); inf: uniform in
            [0, magnitude] (RandAugment's `mstd` above 100, AugMix's default).
        magnitude_max: the magnitude's upper clip (`mmax`; default 10).
        increasing: RandAugment's increasing-severity op variants (`inc1`).
        choices: RandAugment's op set: None (the plain list), `w0` (timm's old
            positional weights), or `weights`, `3a`, `3aw` (timm's `-t` sets).
        width, depth, alpha, blended: AugMix's chains, ops per chain (0: 1-3 at
            random), Dirichlet/Beta parameter and blended mode.
    """

    kind: str
    name: str = ""
    magnitude: float = 10.0
    num_layers: int = 2
    prob: float = 0.5
    magnitude_std: float = 0.0
    magnitude_max: float | None = None
    increasing: bool = False
    choices: str | None = None
    width: int = 3
    depth: int = 0
    alpha: float = 1.0
    blended: bool = False


def _int(text: str, low: int = 0) -> int:
    if not text.isdigit() or int(text) < low:
        raise PolicyError(f"{text!r} is not a whole number of at least {low}")
    return int(text)


def _float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise PolicyError(f"{text!r} is not a number") from None
    if not math.isfinite(value) or value < 0:
        raise PolicyError(f"{text!r} is not a number of at least 0")
    return value


def _bit(text: str) -> bool:
    if text not in ("0", "1"):
        raise PolicyError(f"{text!r} is not 0 or 1")
    return text == "1"


def _prob(text: str) -> float:
    value = _float(text)
    if value > 1:
        raise PolicyError(f"{text!r} is not a probability in [0, 1]")
    return value


def _positive(text: str) -> float:
    value = _float(text)
    if value <= 0:
        raise PolicyError(f"{text!r} is not a number above 0")
    return value


def _std(text: str) -> float:
    value = _float(text)
    return math.inf if value > 100 else value  # timm: above 100 means uniform


# section key -> (PolicySpec field, parser), per policy kind
_RAND_KEYS = {
    "m": ("magnitude", _int),
    "n": ("num_layers", _int),
    "p": ("prob", _prob),
    "mstd": ("magnitude_std", _std),
    "mmax": ("magnitude_max", _int),
    "inc": ("increasing", _bit),
}
_AUGMIX_KEYS = {
    "m": ("magnitude", _int),
    "w": ("width", functools.partial(_int, low=1)),
    "d": ("depth", _int),
    "a": ("alpha", _positive),
    "b": ("blended", _bit),
    "mstd": ("magnitude_std", _float),
}
_AUTO_KEYS = {"mstd": ("magnitude_std", _float)}


def parse_policy(text: str) -> PolicySpec:
    """The `PolicySpec` of a timm `auto_augment` string.

    Raises:
        PolicyError: the string is not in the grammar (`GRAMMAR`), saying which part.
    """
    if not isinstance(text, str):
        raise PolicyError(f"{text!r} is not a string")
    head, *sections = text.split("-")
    if head == "trivialaugment" and not sections:
        return PolicySpec("trivial")
    if head == "rand":
        return _parse_sections(PolicySpec("rand"), sections, _RAND_KEYS)
    if head == "augmix":
        # AugMix's magnitude is drawn uniformly in [0, m] unless mstd says otherwise
        default = PolicySpec("augmix", magnitude=3, magnitude_std=math.inf, depth=0)
        return _parse_sections(default, sections, _AUGMIX_KEYS)
    if head in AUTO_POLICIES:
        return _parse_sections(PolicySpec("auto", name=head), sections, _AUTO_KEYS)
    raise PolicyError(f"unknown policy {head!r}")


def _parse_sections(spec: PolicySpec, sections: list[str], keys: dict) -> PolicySpec:
    values: dict[str, object] = {}
    for section in sections:
        if spec.kind == "rand" and section.startswith("t"):
            name, value = "choices", section[1:]
            if value not in RAND_CHOICES:
                raise PolicyError(f"section {section!r}: -t takes one of {', '.join(RAND_CHOICES)}")
        elif spec.kind == "rand" and section.startswith("w"):
            name, value = "choices", "w0"
            if section != "w0":
                raise PolicyError(f"section {section!r}: timm's only weight set is w0")
        else:
            match = _SECTION.match(section)
            if not match or match.group(1) not in keys:
                allowed = f"one of {', '.join(keys)} followed by a number"
                if spec.kind == "rand":
                    allowed += ", w0, or t{weights|3a|3aw}"
                raise PolicyError(f"section {section!r} is not {allowed}")
            name, parse = keys[match.group(1)]
            try:
                value = parse(match.group(2))
            except PolicyError as error:
                raise PolicyError(f"section {section!r}: {error}") from None
        if name in values:
            raise PolicyError(f"section {section!r} repeats {name}")
        values[name] = value
    spec = dataclasses.replace(spec, **values)
    distinct = _WEIGHTED_SIZES.get(spec.choices)
    if distinct is not None and spec.num_layers > distinct:
        raise PolicyError(
            f"n{spec.num_layers}: weighted choice draws distinct ops, at most {distinct}"
        )
    return spec

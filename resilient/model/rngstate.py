"""The random streams a training draws from, as a state of arrays: a resume draws what an
uninterrupted run would have drawn.

:func:`rng_state` takes the global generators (Python's ``random``, numpy's legacy global
``np.random``, and, where the program has imported torch, torch's CPU generator and, where
CUDA is initialised, every CUDA device's) and the generators the loop owns, given by name
(``np.random.Generator``, ``random.Random``, ``torch.Generator``), and returns them as a
nested dict of numpy arrays and names: a leaf of a checkpoint state like any other, written as
arrays and checksummed, never pickled. :func:`set_rng_state` checks a restored one against the
generators of this process (its format, every part's name, kind, dtype and shape) and only
then sets them all, or raises :class:`~resilient.errors.ConfigError` naming the part and sets
none.

The states are per process: in a checkpoint they are each rank's own data, so a restore on the
same number of ranks gives each rank its own streams back. A checkpoint holding them cannot be
restored onto another number of ranks (an elastic restore refuses per-rank data that is
neither a Block nor Replicated, naming the leaves): a run on another rank count draws other
numbers anyway (each rank's share of a batch differs), so there is nothing bit-identical to
keep; leave the streams out of such a state and seed them anew, from the step and the rank.

Neither function is collective. ``import resilient`` does not import torch, and neither does
:func:`rng_state` (only a process that has imported torch has torch streams to save).
"""

from __future__ import annotations

import logging
import random
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from resilient.errors import ConfigError
from resilient.model import torchlazy

__all__ = ["FORMAT", "rng_state", "set_rng_state"]

log = logging.getLogger(__name__)

FORMAT = "resilient.rng/1"
"""The ``format`` entry of a state of :func:`rng_state`: what :func:`set_rng_state` accepts."""

_PY_WORDS = 625  # random.getstate(): 624 words of MT19937 and the position


# --------------------------------------------------------------------------- save


def rng_state(generators: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """This process's random streams, as a checkpoint leaf (a dict of arrays and names).

    Args:
        generators: the generators the loop owns, by a name of the caller's choosing (the
            same names for :func:`~resilient.set_rng_state`): ``np.random.Generator``,
            ``random.Random`` or ``torch.Generator``.

    Returns:
        ``{"format", "python", "numpy", "torch"?, "generators"?}``: ``torch`` where the
        program has imported torch (``cpu``, and ``cuda`` with one state per device where CUDA
        is initialised), ``generators`` where some were given.

    Raises:
        ConfigError: a generator of another kind (naming it).
    """
    state: dict[str, Any] = {
        "format": FORMAT,
        "python": _python_state(random.getstate()),
        "numpy": _legacy_state(np.random.get_state()),
    }
    torch = torchlazy.loaded()
    if torch is not None:
        streams: dict[str, Any] = {"cpu": _bytes_of(torch.get_rng_state())}
        if torch.cuda.is_initialized():
            devices = torch.cuda.get_rng_state_all()
            streams["cuda"] = {str(i): _bytes_of(s) for i, s in enumerate(devices)}
        state["torch"] = streams
    if generators:
        state["generators"] = {
            str(name): _generator_state(str(name), g) for name, g in generators.items()
        }
    return state


def _bytes_of(tensor: Any) -> np.ndarray:
    """A torch generator state (a uint8 CPU tensor) as a numpy array of its own."""
    return np.array(tensor.cpu().numpy(), dtype=np.uint8, copy=True)


def _python_state(got: tuple[Any, ...]) -> dict[str, np.ndarray]:
    version, internal, gauss = got
    return {
        "version": np.array([version], dtype=np.int64),
        "internal": np.array(internal, dtype=np.uint32),
        "gauss_next": np.array([] if gauss is None else [gauss], dtype=np.float64),
    }


def _legacy_state(got: Any) -> dict[str, np.ndarray]:
    name, key, pos, has_gauss, cached = got
    if name != "MT19937":  # numpy's legacy global stream is always MT19937
        raise ConfigError(f"numpy's global random stream is a {name}, not an MT19937")
    return {
        "key": np.array(key, dtype=np.uint32),
        "pos": np.array([pos], dtype=np.int64),
        "has_gauss": np.array([has_gauss], dtype=np.int64),
        "cached_gaussian": np.array([cached], dtype=np.float64),
    }


def _generator_state(name: str, g: Any) -> dict[str, Any]:
    if isinstance(g, np.random.Generator):
        return {"kind": "numpy", "state": _encode(g.bit_generator.state)}
    if isinstance(g, random.Random):
        return {"kind": "python", "state": _python_state(g.getstate())}
    torch = torchlazy.loaded()
    if torch is not None and isinstance(g, torch.Generator):
        return {"kind": "torch", "device": str(g.device), "state": _bytes_of(g.get_state())}
    raise ConfigError(
        f"generator {name!r} is a {type(g).__name__}: rng_state takes np.random.Generator, "
        "random.Random and torch.Generator"
    )


def _encode(value: Any) -> Any:
    """A numpy bit generator's state as arrays: integers (128 bits for PCG64) as their
    little-endian two's-complement bytes, arrays copied, names kept."""
    if isinstance(value, Mapping):
        return {str(k): _encode(v) for k, v in value.items()}
    if isinstance(value, np.ndarray):
        return value.copy()
    if isinstance(value, str):
        return value
    if isinstance(value, (int, np.integer)):
        n = int(value)
        return np.frombuffer(n.to_bytes(n.bit_length() // 8 + 1, "little", signed=True), np.uint8)
    raise ConfigError(f"a bit generator's state holds a {type(value).__name__}")


# --------------------------------------------------------------------------- restore


def set_rng_state(saved: Mapping[str, Any], generators: Mapping[str, Any] | None = None) -> None:
    """Set this process's random streams from a state of :func:`~resilient.rng_state` (restored
    from a checkpoint), and the given generators (the same names as at the save).

    Everything is checked before anything is set. CUDA states are set on the devices that
    exist here; where CUDA is not available, or a saved device is missing, one warning says
    that they are not restored (the run goes on, no longer bit-identical).

    Raises:
        ConfigError: not such a state, or a part that does not fit this process (another
            kind of generator, other names, a damaged array): naming it; nothing is set.
    """
    if not isinstance(saved, Mapping) or saved.get("format") != FORMAT:
        got = saved.get("format") if isinstance(saved, Mapping) else type(saved).__name__
        raise ConfigError(
            f"not a random-stream state of resilient.rng_state (format {got!r}, expected "
            f"{FORMAT!r})"
        )
    known = {"format", "python", "numpy", "torch", "generators"}
    if extra := sorted(set(saved) - known):
        raise ConfigError(f"random-stream state: unknown parts {extra}")
    setters = [
        _python_setter("python", saved.get("python"), random.setstate),
        _legacy_setter(saved.get("numpy")),
    ]
    if "torch" in saved:
        setters.extend(_torch_setters(saved["torch"]))
    setters.extend(_generator_setters(saved.get("generators") or {}, generators or {}))
    for apply in setters:  # all checked: now set
        apply()


def _array(where: str, value: Any, dtype: Any, shape: tuple[int, ...] | None) -> np.ndarray:
    """``value`` as an array of ``dtype`` (and ``shape``), else a ConfigError naming ``where``."""
    if hasattr(value, "numpy") and not isinstance(value, np.ndarray):  # a tensor leaf
        value = value.detach().cpu().numpy()
    if not isinstance(value, np.ndarray) or value.dtype != np.dtype(dtype):
        kind = value.dtype if isinstance(value, np.ndarray) else type(value).__name__
        raise ConfigError(f"random-stream state {where!r}: {kind}, expected {np.dtype(dtype)}")
    if shape is not None and value.shape != shape:
        raise ConfigError(f"random-stream state {where!r}: shape {value.shape}, expected {shape}")
    return value


def _parts(where: str, value: Any, names: set[str]) -> Mapping[str, Any]:
    if not isinstance(value, Mapping) or set(value) != names:
        got = sorted(value) if isinstance(value, Mapping) else type(value).__name__
        raise ConfigError(f"random-stream state {where!r}: holds {got}, expected {sorted(names)}")
    return value


def _python_setter(where: str, value: Any, apply: Any) -> Any:
    parts = _parts(where, value, {"version", "internal", "gauss_next"})
    version = int(_array(f"{where}/version", parts["version"], np.int64, (1,))[0])
    internal = _array(f"{where}/internal", parts["internal"], np.uint32, (_PY_WORDS,))
    gauss = _array(f"{where}/gauss_next", parts["gauss_next"], np.float64, None)
    if gauss.shape not in ((0,), (1,)):
        raise ConfigError(f"random-stream state {where + '/gauss_next'!r}: shape {gauss.shape}")
    state = (version, tuple(int(v) for v in internal), float(gauss[0]) if gauss.size else None)
    try:
        random.Random().setstate(state)  # checked on a scratch generator
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"random-stream state {where!r}: {exc}") from None
    return lambda: apply(state)


def _legacy_setter(value: Any) -> Any:
    parts = _parts("numpy", value, {"key", "pos", "has_gauss", "cached_gaussian"})
    state = (
        "MT19937",
        _array("numpy/key", parts["key"], np.uint32, (624,)),
        int(_array("numpy/pos", parts["pos"], np.int64, (1,))[0]),
        int(_array("numpy/has_gauss", parts["has_gauss"], np.int64, (1,))[0]),
        float(_array("numpy/cached_gaussian", parts["cached_gaussian"], np.float64, (1,))[0]),
    )
    try:
        np.random.RandomState().set_state(state)
    except (ValueError, TypeError) as exc:
        raise ConfigError(f"random-stream state 'numpy': {exc}") from None
    return lambda: np.random.set_state(state)


def _torch_setters(value: Any) -> list[Any]:
    if not isinstance(value, Mapping) or "cpu" not in value or set(value) - {"cpu", "cuda"}:
        raise ConfigError("random-stream state 'torch': expected 'cpu' and maybe 'cuda'")
    torch = torchlazy.load()  # the program drew from torch when it saved
    cpu = _array("torch/cpu", value["cpu"], np.uint8, torch.get_rng_state().shape)
    setters = [lambda: torch.set_rng_state(torch.from_numpy(cpu.copy()))]
    cuda = value.get("cuda") or {}
    if not isinstance(cuda, Mapping):
        raise ConfigError("random-stream state 'torch/cuda': not a mapping of devices")
    states = {}
    for index, got in cuda.items():
        if not str(index).isdigit():
            raise ConfigError(f"random-stream state 'torch/cuda/{index}': not a device index")
        states[int(index)] = _array(f"torch/cuda/{index}", got, np.uint8, None)
    if not states:
        return setters
    here = torch.cuda.device_count() if torch.cuda.is_available() else 0
    missing = sorted(i for i in states if i >= here)
    if missing:
        log.warning(
            "the random streams of CUDA device(s) %s are not restored: %s; the run goes on, "
            "but it draws other numbers than an uninterrupted run would",
            missing, "CUDA is not available here" if here == 0 else f"{here} device(s) here",
        )  # fmt: skip

    def on_device(index: int, state: np.ndarray) -> Callable[[], None]:
        return lambda: torch.cuda.set_rng_state(torch.from_numpy(state.copy()), index)

    setters.extend(on_device(i, s) for i, s in states.items() if i < here)
    return setters


def _generator_setters(saved: Any, given: Mapping[str, Any]) -> list[Any]:
    if not isinstance(saved, Mapping):
        raise ConfigError("random-stream state 'generators': not a mapping")
    names = {str(k) for k in given}
    if set(saved) != names:
        raise ConfigError(
            f"random-stream state: the checkpoint holds the generators {sorted(saved)}, this "
            f"call gives {sorted(names)}: give the same names as at the save"
        )
    return [_generator_setter(str(name), saved[str(name)], g) for name, g in given.items()]


def _generator_setter(name: str, saved: Any, g: Any) -> Any:
    where = f"generators/{name}"
    kind = _generator_state(name, g)["kind"]  # the generator given, as at a save
    if not isinstance(saved, Mapping) or saved.get("kind") != kind:
        got = saved.get("kind") if isinstance(saved, Mapping) else type(saved).__name__
        raise ConfigError(f"random-stream state {where!r}: a {got} generator, given a {kind} one")
    if kind == "python":
        return _python_setter(f"{where}/state", saved.get("state"), g.setstate)
    if kind == "torch":
        want = g.get_state()
        state = _array(f"{where}/state", saved.get("state"), np.uint8, tuple(want.shape))
        torch = torchlazy.load()
        return lambda: g.set_state(torch.from_numpy(state.copy()))
    template = g.bit_generator.state
    decoded = _decode(f"{where}/state", saved.get("state"), template)
    try:
        type(g.bit_generator)().state = decoded  # checked on a scratch bit generator
    except (ValueError, TypeError, KeyError) as exc:
        raise ConfigError(f"random-stream state {where!r}: {exc}") from None

    def apply() -> None:
        g.bit_generator.state = decoded

    return apply


def _decode(where: str, saved: Any, template: Any) -> Any:
    """:func:`_encode`'s output back, shaped like ``template`` (this generator's state now)."""
    if isinstance(template, Mapping):
        if not isinstance(saved, Mapping) or set(saved) != {str(k) for k in template}:
            got = sorted(saved) if isinstance(saved, Mapping) else type(saved).__name__
            raise ConfigError(
                f"random-stream state {where!r}: holds {got}, expected {sorted(template)}"
            )
        return {k: _decode(f"{where}/{k}", saved[str(k)], v) for k, v in template.items()}
    if isinstance(template, str):
        if saved != template:
            raise ConfigError(
                f"random-stream state {where!r}: {saved!r}, this generator is {template!r}"
            )
        return template
    if isinstance(template, np.ndarray):
        return _array(where, saved, template.dtype, template.shape).copy()
    if isinstance(template, (int, np.integer)):
        raw = _array(where, saved, np.uint8, None)
        if raw.size == 0 or raw.size > 64:
            raise ConfigError(f"random-stream state {where!r}: {raw.size} bytes for an integer")
        return int.from_bytes(raw.tobytes(), "little", signed=True)
    raise ConfigError(f"random-stream state {where!r}: a {type(template).__name__} in the template")

"""qflash's changes to private SGLang symbols: one module per feature (each with its CHANGES), installed and
verified here; server/plugin.py says which features each plugin installs.

Each module names SGLang 0.5.17 internals, which can change meaning in any release, so `install` refuses
any other version once, installs every change (through SGLang's HookRegistry wherever it can reach the
symbol), then checks that each one is in place. SGLang's plugin loader logs and swallows a plugin's
exceptions, and HookRegistry logs and skips a target it cannot resolve: either would leave a server
running without qflash's fixes and nothing a user would notice. So a refusal is a SystemExit (`Refused`),
which stops the server process, with one line naming what is missing and the SGLang version found.
A change is anything with a `target` (what it changes, for the messages) and an `install()` that returns its
in-place check: a `Hook`, or a module's own class where a hook cannot reach (a logger's filter, an entry
of FastAPI's handler table).
"""

import pkgutil
import sys
from dataclasses import dataclass
from importlib.metadata import version
from typing import Any, Callable

PINNED_SGLANG = "0.5.17"
APPLIED = "qflash: {count} hooks applied on sglang {version}: {names}"  # the start-up line `qflash serve` waits for
REFUSED = "qflash: refusing to start: "
_INSTALLED: set = set()  # changes in place in this process


class Refused(SystemExit):
    """qflash cannot change this SGLang as it must: the process stops."""

    def __init__(self, why: str):
        super().__init__(REFUSED + why)


def resolve(target: str) -> Any:
    """The object at a dotted path `module.Class.attr`; raises if any part does not exist."""
    owner, _, attr = target.rpartition(".")
    obj = pkgutil.resolve_name(owner)
    raw = vars(obj).get(attr) if isinstance(obj, type) else None
    return raw.__func__ if isinstance(raw, (classmethod, staticmethod)) else getattr(obj, attr)


@dataclass(frozen=True)
class Hook:
    """`fn` runs BEFORE, AFTER, AROUND or instead of (REPLACE) the function at `target`, through SGLang's HookRegistry."""

    target: str
    fn: Callable
    kind: str  # "BEFORE" | "AFTER" | "AROUND" | "REPLACE"

    def install(self) -> Callable[[], bool]:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        original = resolve(self.target)
        HookRegistry.register(self.target, self.fn, HookType[self.kind])
        return lambda: resolve(self.target) is not original


def install(changes: list, extra_check: Callable[[], list[str]] = lambda: []) -> list[str]:
    """Install `changes` into this process's SGLang and verify them (plus `extra_check`, which returns what is
    missing); raise Refused naming what failed. Returns the targets changed."""
    found = version("sglang")
    if found != PINNED_SGLANG:
        raise Refused(f"qflash changes SGLang {PINNED_SGLANG} internals; found sglang {found}")
    try:
        return _install(changes, extra_check, found)
    except (ImportError, AttributeError, ValueError, TypeError) as exc:  # a target or registry that is not there
        raise Refused(f"{type(exc).__name__} in sglang {found}: {exc}") from exc


def _install(changes: list, extra_check: Callable[[], list[str]], found: str) -> list[str]:
    from sglang.srt.plugins.hook_registry import HookRegistry

    checks = []
    for change in changes:
        if change in _INSTALLED:  # both plugins load where SGLANG_PLUGINS is unset: the shared ones once
            continue
        try:
            checks.append((change.target, change.install()))
        except (ImportError, AttributeError, ValueError) as exc:
            raise Refused(f"{change.target} does not exist in sglang {found} ({type(exc).__name__}: {exc})") from exc
    _INSTALLED.update(changes)
    HookRegistry.apply_hooks()  # idempotent: SGLang's loader applies again after every plugin, skipping these
    missing = [target for target, in_place in checks if not in_place()] + extra_check()
    if missing:
        raise Refused(f"not in place in sglang {found}: {', '.join(missing)}")
    targets = list(dict.fromkeys(target for target, _ in checks))
    names = ", ".join(".".join(t.split(".")[-2:]) for t in targets)
    # printed, not logged: plugins load before SGLang configures its logging, and `qflash serve` reads this line
    print(APPLIED.format(count=len(targets), version=found, names=names), file=sys.stderr, flush=True)
    return targets

"""Watch every admission decision a simulation makes: a benchmark's window on `AdmissionController.check`.

`watching_admission(on_check)`: while the block runs, every `AdmissionController.check` (the
unit's admission rules, tidal_core/admission.py) calls `on_check(controller, request, state,
verdict)` after it decides, `verdict` being the `Rejection` or None; the check itself is unchanged
and is restored when the block ends. The simulator builds its schedulers inside, so this is how
a benchmark sees what each rule judged by (benchmarks/slow_prompts.py, benchmarks/alone_bound.py).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import Any

from tidal_core.admission import AdmissionController, UnitState

OnCheck = Callable[[AdmissionController, Any, UnitState, Any], None]


@contextlib.contextmanager
def watching_admission(on_check: OnCheck) -> Iterator[None]:
    check = AdmissionController.check

    def watched(self: AdmissionController, req: Any, state: UnitState, load: Any) -> Any:
        verdict = check(self, req, state, load)
        on_check(self, req, state, verdict)
        return verdict

    AdmissionController.check = watched  # type: ignore[method-assign]
    try:
        yield
    finally:
        AdmissionController.check = check  # type: ignore[method-assign]

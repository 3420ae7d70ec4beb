"""Finding a task by name: the built-ins, their presets, and user tasks.

A run spec names its task as ``"charlm"``, ``"synthetic"`` or
``"package.module:function"``; for the last, ``function(params)`` is called
and must return an object that satisfies :class:`~.base.Task`. Only modules
already installed on the node can be imported: the name is checked against a
strict pattern and nothing is downloaded or evaluated from the spec itself.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Callable, Mapping

from . import charlm, synthetic
from .base import Task, TaskError, check_json_params

#: Built-in task constructors by name.
BUILTIN_TASKS: dict[str, Callable[[Mapping[str, object] | None], Task]] = {
    "charlm": charlm.CharLMTask,
    "synthetic": synthetic.SyntheticTask,
}

#: ``TASK_PRESETS[task][preset]`` is a full, canonical parameter mapping.
TASK_PRESETS: dict[str, dict[str, dict[str, object]]] = {
    "charlm": {k: charlm.CharLMTask(v).params for k, v in charlm.PRESETS.items()},
    "synthetic": {k: synthetic.SyntheticTask(v).params for k, v in synthetic.PRESETS.items()},
}

_USER_TASK = re.compile(
    r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_]*$"
)


def load_task(name: str, params: Mapping[str, object] | None = None) -> Task:
    """The task called ``name`` with ``params`` (defaults filled in, validated).

    Raises :class:`TaskError` for an unknown built-in, a malformed
    ``module:function`` name, a module or function that cannot be found, or
    a factory that does not return a :class:`Task`.
    """
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name](params)
    if not isinstance(name, str) or not _USER_TASK.match(name):
        raise TaskError(f"unknown task {name!r}: not a built-in and not 'module:function'")
    module_name, func_name = name.split(":")
    user_params = check_json_params(name, params)
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise TaskError(f"task module {module_name!r} cannot be imported: {exc}") from exc
    factory = getattr(module, func_name, None)
    if not callable(factory):
        raise TaskError(f"task module {module_name!r} has no callable {func_name!r}")
    task = factory(user_params)
    if not isinstance(task, Task):
        raise TaskError(f"{name!r} returned {type(task).__name__}, which is not a Task")
    return task

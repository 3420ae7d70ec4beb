"""Training tasks: model factory, data and loss for one kind of run."""

from .base import Dataset, Task, TaskError
from .charlm import CharLMDataset, CharLMTask, GPTConfig
from .registry import BUILTIN_TASKS, TASK_PRESETS, load_task
from .synthetic import SyntheticDataset, SyntheticTask

__all__ = [
    "BUILTIN_TASKS",
    "TASK_PRESETS",
    "CharLMDataset",
    "CharLMTask",
    "Dataset",
    "GPTConfig",
    "SyntheticDataset",
    "SyntheticTask",
    "Task",
    "TaskError",
    "load_task",
]

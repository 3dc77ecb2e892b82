"""LoRA adapters served beside a base model: PEFT's format read (peft.py), where its modules sit in our
models (targets.py), the per-row low-rank products (lora.py), a classification adapter's own head (heads.py)
and the slots a model holds (resident.py)."""

from .heads import AdapterHead
from .lora import LoraLinear, project
from .peft import AdapterError, LoraAdapter, read_adapter
from .resident import AdaptersFull, Held, ResidentAdapters

__all__ = ["AdapterError", "AdapterHead", "AdaptersFull", "Held", "LoraAdapter", "LoraLinear", "ResidentAdapters", "project", "read_adapter"]

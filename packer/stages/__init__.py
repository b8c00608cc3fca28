"""The pack stages in order: convert (many workers), plan (one), materialize (many; the last finalizes)."""

from packtrain.packer.stages.convert import convert
from packtrain.packer.stages.finalize import finalize
from packtrain.packer.stages.materialize import materialize
from packtrain.packer.stages.plan import plan

__all__ = ["convert", "finalize", "materialize", "plan"]

"""Take the improved agent anywhere: export an adapter (PEFT, merged, GGUF LoRA, Ollama) with a parity check, and
import an external PEFT LoRA as an agent's adapter (docs/export.md)."""

from metaclaw.export.runs import ExportError, RunAdapters

__all__ = ["ExportError", "RunAdapters"]

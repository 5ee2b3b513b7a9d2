"""A model source checked, and converted once where it needs it, before any replica or actor
loads it: `dsbd serve` (deployments/local_serve.py) and `dsbd batch`
(deployments/batch_job/job.py) call it in their parent process. A transformers directory or a
hub id is only checked (`presets.locate_source`, no torch or transformers import); presets and
GGUF files are converted into the cache (`loading.resolve_source`, which imports them)."""

from __future__ import annotations

from dsbd_core.models.presets import locate_source


def prepare_source(source: str) -> None:
    """Raises ModelSourceError naming what is accepted for a source that is none of them."""
    kind, _ = locate_source(source)
    if kind in ("preset", "gguf"):
        from dsbd_core.models.loading import resolve_source

        resolve_source(source)

"""Checkpoints: the store (save, list, rotate, resume, load), manifests (checksums, verification), the final export."""
